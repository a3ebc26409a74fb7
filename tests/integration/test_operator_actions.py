"""Every operator action the README documents, in every way Sluice runs (issue 39
item 16): one ``sluice serve`` process, ``sluice serve --workers 2``, and two
replicas (two ``sluice serve`` on one Redis in front of one ``external`` engine).

* reload on SIGHUP: every gateway process reloads its files, and keeps serving;
* reload on a file change: a tenant added to ``tenants.yaml`` is served by every
  gateway process;
* stop with SIGTERM and with SIGINT (Ctrl-C): requests in flight are drained (each
  stream ends whole, ``[DONE]`` and usage), every process exits with status 0 and
  leaves no process behind (the launched engine is stopped).

The operator signals what they started: the one process, the ``--workers`` parent,
or each replica. Each gateway process serves ``/metrics`` on its own port
(``observability.metrics_listen``; worker i on port + i), which is how a test sees
each one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.launch import RedisServer
from tests.conftest import free_port
from tests.integration.limits_support import auth, chat, sim_engine, tenant, write_config
from tests.integration.test_workers import metrics_port_pair
from tests.support import wait_for, wait_for_sync

pytestmark = pytest.mark.timeout(180)

MODES = ["one", "workers", "replicas"]
SPEED = 10.0  # the simulator's speed: ~5 ms per output token
STREAM_TOKENS = 600  # a stream of ~3 s, still running when the signal comes


@dataclass
class Deployment:
    """What an operator runs: ``signalled`` (the processes they signal), ``url``
    (where clients connect), ``metrics`` (one ``/metrics`` URL per gateway process),
    ``config_dirs`` (one folder per process the operator configures), ``logs``."""

    signalled: list[subprocess.Popen[bytes]]
    url: list[str]
    metrics: list[str]
    config_dirs: list[Path]
    logs: list[Path]
    family: list[psutil.Process] = field(default_factory=list)

    def log_tail(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in self.logs if p.exists())


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _serve(config_dir: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config-dir", str(config_dir),
         "--port", str(port), *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _config(directory: Path, engines: list[dict], metrics_port: int,
            redis_url: str | None) -> Path:
    # SLO targets no stream here can miss: these tests are about the operator's
    # actions, not about shedding (on a loaded machine the shipped 2 s TTFT target
    # sheds some of the streams)
    slo = {"ttft_s": 120.0, "tpot_s": 1.0}
    gateway: dict = {"observability": {"access_log": False, "tracing": False,
                                       "metrics_listen": f"127.0.0.1:{metrics_port}"},
                     "drain_grace_s": 30,
                     "slo": {"interactive": slo, "standard": slo, "batch": slo}}
    if redis_url:
        gateway["limits"] = {"store_url": redis_url, "redis_timeout_s": 5.0}
    write_config(directory, tenants=[tenant("t")], engines=engines, gateway=gateway,
                 saturation={"max_waiting": 1000})
    # an engine gets 0.5 s after SIGTERM (the simulator, like vLLM's server, finishes
    # its streams on SIGTERM): only the gateway's own drain keeps a stream whole
    doc = yaml.safe_load((directory / "engines.yaml").read_text())
    doc["supervisor"]["stop_grace_s"] = 0.5
    (directory / "engines.yaml").write_text(yaml.safe_dump(doc))
    return directory


@contextmanager
def deploy(mode: str, tmp_path: Path, engines: int = 1) -> Iterator[Deployment]:
    """Start ``mode``'s gateways in front of ``engines`` simulated engines (``sim``,
    ``sim2``; for replicas, Redis and the engines as ``external`` ones); yield once
    every gateway process is ready; stop whatever is left at the end."""
    names = ["sim", "sim2"][:engines]
    with ExitStack() as stack:
        procs: list[subprocess.Popen[bytes]] = []

        def stop_all() -> None:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

        stack.callback(stop_all)
        if mode in ("one", "workers"):
            workers = 2 if mode == "workers" else 1
            mport, port = metrics_port_pair(), free_port()
            cfg = _config(tmp_path / "cfg", [sim_engine(n, speed=SPEED) for n in names],
                          mport, None)
            log = tmp_path / "serve.log"
            procs.append(_serve(cfg, port, log, *(["--workers", "2"] if workers > 1 else [])))
            d = Deployment(list(procs), [f"http://127.0.0.1:{port}"],
                           [f"http://127.0.0.1:{mport + i}/metrics" for i in range(workers)],
                           [cfg], [log])
        else:
            redis = RedisServer()
            redis.start()
            stack.callback(redis.stop)
            externals, logs = [], []
            for name in names:
                eport = free_port()
                logs.append(tmp_path / f"{name}.log")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "loadtest.sim_engine", "--host", "127.0.0.1",
                     "--port", str(eport), "--model", "sim-model",
                     *sim_engine(speed=SPEED)["args"]],
                    stdout=logs[-1].open("wb"), stderr=subprocess.STDOUT))
                externals.append({"name": name, "model": "sim-model", "kind": "external",
                                  "url": f"http://127.0.0.1:{eport}"})
            replicas, urls, metrics, dirs = [], [], [], []
            for i in range(2):
                mport, port = free_port(), free_port()
                cfg = _config(tmp_path / f"cfg{i}", externals, mport, redis.url)
                logs.append(tmp_path / f"replica{i}.log")
                replicas.append(_serve(cfg, port, logs[-1]))
                urls.append(f"http://127.0.0.1:{port}")
                metrics.append(f"http://127.0.0.1:{mport}/metrics")
                dirs.append(cfg)
            procs.extend(replicas)
            d = Deployment(replicas, urls, metrics, dirs, logs)

        def ready() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"exited {p.returncode}: {d.log_tail()}")
            try:
                return all(httpx.get(u, timeout=2).status_code == 200 for u in d.metrics) and all(
                    httpx.get(u + "/ready", timeout=2).status_code == 200
                    for u in d.url for _ in range(4 * len(d.metrics)))
            except httpx.HTTPError:
                return False

        wait_for_sync(ready, 90, f"the {mode} deployment to be ready")
        d.family = [c for p in d.signalled for c in psutil.Process(p.pid).children(recursive=True)]
        yield d


def reloads(d: Deployment) -> list[float]:
    return [metric(u, "sluice_config_reloads_total", result="ok") for u in d.metrics]


@pytest.mark.parametrize("mode", MODES)
def test_sighup_reloads_every_gateway_process(mode: str, tmp_path: Path) -> None:
    with deploy(mode, tmp_path) as d:
        before = reloads(d)
        for p in d.signalled:
            p.send_signal(signal.SIGHUP)
        # SIGHUP reloads both watched files (tenants, engines), changed or not
        wait_for_sync(lambda: all(a >= b + 2 for a, b in zip(reloads(d), before, strict=True)),
                      20, f"every process to reload on SIGHUP ({before})")
        assert all(p.poll() is None for p in d.signalled), d.log_tail()
        for url in d.url:
            r = httpx.post(url + "/v1/chat/completions", json=chat(), headers=auth("t"),
                           timeout=30)
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_tenants_file_reaches_every_gateway_process(mode: str, tmp_path: Path) -> None:
    with deploy(mode, tmp_path) as d:
        r = httpx.post(d.url[0] + "/v1/chat/completions", json=chat(), headers=auth("late"))
        assert r.status_code == 401
        for cfg in d.config_dirs:  # an atomic replace, as an editor or `mv` does
            doc = yaml.safe_load((cfg / "tenants.yaml").read_text())
            doc["tenants"].append(tenant("late"))
            (cfg / "tenants.yaml.new").write_text(yaml.safe_dump(doc))
            os.replace(cfg / "tenants.yaml.new", cfg / "tenants.yaml")

        def every_process_served_late() -> bool:
            for url in d.url:  # a new connection each: the kernel picks the worker
                httpx.post(url + "/v1/chat/completions", json=chat(), headers=auth("late"),
                           timeout=30)
            return all(metric(u, "sluice_requests_total", tenant="late", status="200") > 0
                       for u in d.metrics)

        wait_for_sync(every_process_served_late, 30, "every process to serve the new tenant")


async def _stream(url: str, started: asyncio.Queue[str]) -> tuple[int, int, bool, str]:
    """One long stream on its own connection: (status, completion tokens, [DONE] seen,
    the body when not 200); puts ``url`` on ``started`` once the first bytes arrived."""
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", headers=auth("t"),
            json=chat("drain me", STREAM_TOKENS, stream=True)) as r:
        body = b""
        async for chunk in r.content.iter_any():
            if not body:
                started.put_nowait(url)
            body += chunk
    if r.status != 200:
        return r.status, 0, False, body.decode(errors="replace")
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    usage = [json.loads(e)["usage"] for e in events if e != b"[DONE]" and json.loads(e).get("usage")]
    return r.status, usage[-1]["completion_tokens"] if usage else 0, events[-1:] == [b"[DONE]"], ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("mode", MODES)
async def test_stop_drains_requests_in_flight_and_leaves_nothing(mode: str, sig: int,
                                                                 tmp_path: Path) -> None:
    with deploy(mode, tmp_path) as d:
        started: asyncio.Queue[str] = asyncio.Queue()
        streams: list[asyncio.Task] = []

        def in_flight() -> list[float]:
            return [metric(u, "sluice_engine_requests_in_flight") for u in d.metrics]

        # streams until every gateway process has one in flight (the kernel spreads
        # the workers' connections), at most 12
        async def each_process_busy() -> bool:
            if all(n > 0 for n in in_flight()):
                return True
            if len(streams) < 12:
                url = d.url[len(streams) % len(d.url)]
                streams.append(asyncio.create_task(_stream(url, started)))
                await started.get()
            return False

        await wait_for(each_process_busy, 30, "a stream in flight on every process", poll_s=0.05)
        for p in d.signalled:
            p.send_signal(sig)
        results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        for status, tokens, done, error in results:  # every stream drained whole
            assert (status, tokens, done) == (200, STREAM_TOKENS, True), (error, d.log_tail())
        for p in d.signalled:
            assert await asyncio.to_thread(p.wait, 60) == 0, d.log_tail()
        # the launched engine and the workers are gone too
        _gone, alive = await asyncio.to_thread(psutil.wait_procs, d.family, 15)
        assert not alive, [p.cmdline() for p in alive]


@pytest.mark.parametrize("mode", MODES)
async def test_a_removed_engine_drains_every_processs_requests(mode: str, tmp_path: Path) -> None:
    """engines.yaml loses an engine while streams run on it through every gateway
    process: each stream ends whole before the engine is stopped (with ``--workers``
    the engine's owner, worker 0, must wait for the other workers' requests too)."""
    with deploy(mode, tmp_path, engines=2) as d:
        started: asyncio.Queue[str] = asyncio.Queue()
        streams: list[asyncio.Task] = []

        def on_second() -> list[float]:
            return [metric(u, "sluice_engine_requests_in_flight", engine="sim2")
                    for u in d.metrics]

        async def each_process_busy_on_sim2() -> bool:
            if all(n > 0 for n in on_second()):
                return True
            if len(streams) < 24:
                url = d.url[len(streams) % len(d.url)]
                streams.append(asyncio.create_task(_stream(url, started)))
                await started.get()
            return False

        await wait_for(each_process_busy_on_sim2, 60, "a stream on sim2 in every process",
                       poll_s=0.05)
        for cfg in d.config_dirs:
            doc = yaml.safe_load((cfg / "engines.yaml").read_text())
            doc["engines"] = [e for e in doc["engines"] if e["name"] != "sim2"]
            (cfg / "engines.yaml.new").write_text(yaml.safe_dump(doc))
            os.replace(cfg / "engines.yaml.new", cfg / "engines.yaml")
        results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        for status, tokens, done, error in results:
            assert (status, tokens, done) == (200, STREAM_TOKENS, True), (error, d.log_tail())
