"""Helpers for the limits tests: config folders for ``sluice serve`` with simulated
engines, gateway processes started together, and checks of well-formed rejections."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_key
from tests.conftest import free_port
from tests.support import wait_for_sync

MODEL = "sim-model"
#: Supervisor timings for tests: quick probes and metrics.
FAST_SUPERVISOR = {"probe_interval_s": 0.2, "probe_timeout_s": 2.0, "failure_threshold": 3,
                   "metrics_interval_s": 0.1, "restart_backoff_s": 0.2,
                   "inference_probe_idle_s": 3600, "startup_grace_s": 60}


def tenant(name: str, **quota: Any) -> dict[str, Any]:
    """A tenants.yaml entry whose API key is ``key-<name>``."""
    return {"name": name, "api_key_hashes": [hash_key(f"key-{name}")], **quota}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{name}"}


def sim_engine(name: str = "sim", *, model: str = MODEL, speed: float = 20.0,
               replicas: int = 1, args: list[str] | None = None) -> dict[str, Any]:
    """An engines.yaml entry for the simulated engine (``kind: sim``)."""
    return {"name": name, "model": model, "kind": "sim", "replicas": replicas,
            "args": ["--profile", "cpu-gemma3-270m-quiet", "--speed", str(speed),
                     "--max-model-len", "4096", *(args or [])]}


def write_config(directory: Path, *, tenants: list[dict[str, Any]],
                 engines: list[dict[str, Any]], gateway: dict[str, Any] | None = None,
                 models: list[dict[str, Any]] | None = None,
                 saturation: dict[str, Any] | None = None) -> Path:
    """Write gateway.yaml, engines.yaml and tenants.yaml (cache off) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    gw = {"cache": {"enabled": False}, **(gateway or {})}
    gw.setdefault("observability", {"access_log": False, "tracing": False})
    eng: dict[str, Any] = {"engines": engines, "supervisor": FAST_SUPERVISOR}
    if models:
        eng["models"] = models
    if saturation:
        eng["saturation"] = saturation
    (directory / "gateway.yaml").write_text(yaml.safe_dump(gw))
    (directory / "engines.yaml").write_text(yaml.safe_dump(eng))
    (directory / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    return directory


@dataclass
class GatewayProc:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@contextmanager
def gateways(config_dir: Path, n: int = 1, *, timeout_s: float = 60.0) -> Iterator[list[GatewayProc]]:
    """Start ``n`` ``sluice serve`` processes on one config folder at once; yield
    when every one answers ``/ready`` 200; SIGTERM them all at the end."""
    procs: list[GatewayProc] = []
    try:
        for i in range(n):
            port = free_port()
            log = config_dir / f"gateway-{i}.log"
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config-dir", str(config_dir),
                 "--port", str(port)],
                stdout=log.open("wb"), stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"})
            procs.append(GatewayProc(proc, f"http://127.0.0.1:{port}", log))
        pending = list(procs)

        def all_ready() -> bool:
            for g in list(pending):
                if g.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited: {g.log.read_text()[-2000:]}")
                try:
                    if httpx.get(g.url + "/ready", timeout=1).status_code == 200:
                        pending.remove(g)
                except httpx.HTTPError:
                    pass
            return not pending

        wait_for_sync(all_ready, timeout_s, "the gateways to answer /ready")
        yield procs
    finally:
        for g in procs:
            if g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)
        for g in procs:
            try:
                g.proc.wait(20)
            except subprocess.TimeoutExpired:
                g.proc.kill()
                g.proc.wait()


async def _metric_sum(session: aiohttp.ClientSession, url: str, name: str,
                      **labels: str | None) -> float:
    """The sum of the gateway's ``/metrics`` samples called ``name`` whose labels
    match ``labels`` (a None value matches any)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(m.value for f in text_string_to_metric_families(text) for m in f.samples
               if m.name == name and all(v in (None, m.labels.get(k))
                                         for k, v in labels.items()))


async def queue_depth(session: aiohttp.ClientSession, url: str, *, model: str = MODEL,
                      priority: str | None = None) -> float:
    """Requests waiting in the gateway's admission queue for ``model`` (and
    ``priority``), from its ``/metrics``."""
    return await _metric_sum(session, url, "sluice_queue_depth", model=model,
                             priority=priority)


async def in_flight(session: aiohttp.ClientSession, url: str, *, model: str = MODEL) -> float:
    """Requests the gateway has in flight on ``model``'s engines, from its
    ``/metrics``."""
    return await _metric_sum(session, url, "sluice_engine_requests_in_flight", model=model)


def chat(content: str = "hello there", max_tokens: int = 4, *, stream: bool = False,
         model: str = MODEL) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def check_rejection(status: int, headers: Any, body: Any) -> str:
    """Assert an error answer is a well-formed OpenAI error; 429/503 carry an integer
    ``Retry-After`` ≥ 1. Returns the error code."""
    assert status != 500, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    if status in (429, 503):
        ra = headers.get("Retry-After")
        assert ra is not None and ra.isdigit() and int(ra) >= 1, (status, ra, body)
    return err["code"]
