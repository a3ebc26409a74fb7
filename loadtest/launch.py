"""Start a gateway (``sluice serve``) as a child process for a benchmark, wait until
it is ready, and find the engines it launched."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from engines import process

#: The shipped configuration folder.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def free_port(span: int = 1) -> int:
    """A TCP port P on 127.0.0.1 with P … P + span - 1 free a moment ago, outside the
    OS's ephemeral range (:func:`engines.process.free_port`)."""
    return process.free_port("127.0.0.1", span)


@dataclass
class RunningGateway:
    proc: subprocess.Popen[bytes]
    url: str

    def engine_processes(self) -> list[psutil.Process]:
        """The engine servers the gateway launched (vLLM API servers, llama-servers,
        simulators)."""
        out = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "--port" in cmd and (
                    Path(cmd[0]).name == "llama-server"
                    or any("vllm.entrypoints" in c or "loadtest.sim_engine" in c for c in cmd)):
                out.append(child)
        return out

    def cpu_s(self) -> float:
        """User + system CPU so far of the gateway's own processes (its process tree
        less the engines it launched and their children), s."""
        engines = {q.pid for e in self.engine_processes()
                   for q in (e, *e.children(recursive=True))}
        total = 0.0
        root = psutil.Process(self.proc.pid)
        for proc in (root, *root.children(recursive=True)):
            if proc.pid in engines:
                continue
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def engine_urls(self, model: str | None = None) -> list[str]:
        """``http://127.0.0.1:PORT`` of each engine process the gateway launched (only
        those serving ``model``, by vLLM's ``--served-model-name`` or llama-server's
        ``--alias``, when given: the
        shipped config also launches an embedding engine)."""
        urls = set()
        for proc in self.engine_processes():
            cmd = proc.cmdline()
            names = {cmd[i + 1] for i, a in enumerate(cmd[:-1])
                     if a in ("--served-model-name", "--alias")}  # vLLM, llama-server
            if model is not None and model not in names:
                continue
            urls.add(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}")
        return sorted(urls)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``/ready`` answers 200 and lists every engine as ready: a
        benchmark measures the whole fleet, whereas ``/ready`` needs only one engine
        per model (a run started with one of two engines up sends the first requests,
        and the prefixes they bring, to that one).

        Raises:
            RuntimeError: the gateway exited. TimeoutError: not ready in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}")
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                if r.status_code == 200 and all(
                        state == "ready" for state in r.json()["engines"].values()):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not become ready")
            time.sleep(0.5)


def llamacpp_config(directory: Path, gateway: dict[str, Any] | None = None) -> Path:
    """Write into ``directory`` the shipped configuration with its one engine replaced by
    llama.cpp's ``llama-server`` (``kind: llamacpp``, engine ``llama``, model
    ``gemma3-270m`` on the packaged GGUF, the launch defaults of
    :func:`engines.kinds.llamacpp.command`); ``gateway`` keys replace the shipped
    ``gateway.yaml``'s top-level keys. Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG_DIR / "tenants.yaml", directory / "tenants.yaml")
    gw = yaml.safe_load((CONFIG_DIR / "gateway.yaml").read_text())
    (directory / "gateway.yaml").write_text(yaml.safe_dump({**gw, **(gateway or {})}))
    engines = yaml.safe_load((CONFIG_DIR / "engines.yaml").read_text())
    engines["engines"] = [{"name": "llama", "model": "gemma3-270m", "kind": "llamacpp",
                           "model_path": "packaged:gemma3-270m"}]
    (directory / "engines.yaml").write_text(yaml.safe_dump(engines))
    return directory


@contextmanager
def gateway(config_dir: Path | None = None, *, ready_timeout_s: float = 600,
            log_path: Path | None = None, extra_args: list[str] | None = None,
            ) -> Iterator[RunningGateway]:
    """Run ``sluice serve`` on a free port until the ``with`` block ends (SIGTERM:
    drain and stop the engines).

    Raises:
        TimeoutError: ``/ready`` did not answer 200 within ``ready_timeout_s``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    if config_dir is not None:
        cmd += ["--config-dir", str(config_dir)]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd + (extra_args or []), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    gw = RunningGateway(proc, f"http://127.0.0.1:{port}")
    try:
        gw.wait_ready(ready_timeout_s)
        yield gw
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class RedisServer:
    """A private ``redis-server`` on a free loopback port, no persistence.

    ``url`` is ``redis://127.0.0.1:PORT/0``; :meth:`stop` and :meth:`start` let tests
    take Redis away mid-run and bring it back on the same port.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
