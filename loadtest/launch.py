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

import httpx
import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningGateway:
    proc: subprocess.Popen[bytes]
    url: str

    def engine_processes(self) -> list[psutil.Process]:
        """The engine servers the gateway launched (vLLM API servers, simulators)."""
        out = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "--port" in cmd and any("vllm.entrypoints" in c or "loadtest.sim_engine" in c
                                       for c in cmd):
                out.append(child)
        return out

    def engine_urls(self) -> list[str]:
        """``http://127.0.0.1:PORT`` of each engine process the gateway launched."""
        urls = set()
        for proc in self.engine_processes():
            cmd = proc.cmdline()
            urls.add(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}")
        return sorted(urls)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``/ready`` answers 200.

        Raises:
            RuntimeError: the gateway exited. TimeoutError: not ready in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not become ready")
            time.sleep(0.5)


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
