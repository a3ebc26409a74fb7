"""Supervisor over loopback with real child processes (tests/fakes/fake_engine.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from config.schema import EnginesConfig, EngineSpec
from engines.metrics import MetricsPoller
from engines.pool import Engine, EnginePool, EngineState, MetricsSnapshot
from engines.supervisor import Supervisor, wait_for
from tests import support
from tests.conftest import free_port

FAST = {
    "startup_grace_s": 20.0, "probe_interval_s": 0.1, "probe_timeout_s": 0.5,
    "failure_threshold": 2, "inference_probe_idle_s": 3600.0, "metrics_interval_s": 0.1,
    "metrics_stale_s": 2.0, "restart_backoff_s": 0.1, "restart_backoff_max_s": 0.4,
    "max_restarts": 5, "stop_grace_s": 2.0,
}


def fake_command(spec: EngineSpec, host: str, port: int, model_path: str | None) -> list[str]:
    return [sys.executable, "-m", "tests.fakes.fake_engine", "--host", host, "--port", str(port),
            "--model", spec.model, *spec.args]


def alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def config(*specs: dict[str, Any], **supervisor: Any) -> EnginesConfig:
    return EnginesConfig.model_validate({
        "engines": [{"kind": "sim", "model": "m", **s} for s in specs],
        "supervisor": {**FAST, **supervisor},
    })


class Recorder:
    """Every state an engine passes through, in order, with the time."""

    def __init__(self, pool: EnginePool, engine: Engine) -> None:
        self.engine = engine
        self.states: list[tuple[float, EngineState]] = [(time.monotonic(), engine.state)]
        pool.listeners.append(self)

    def __call__(self) -> None:
        if self.states[-1][1] is not self.engine.state:
            self.states.append((time.monotonic(), self.engine.state))

    @property
    def names(self) -> list[str]:
        return [s.value for _, s in self.states]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def make(session: aiohttp.ClientSession, tmp_path: Path) -> AsyncIterator[Any]:
    made: list[Supervisor] = []

    def _make(cfg: EnginesConfig) -> tuple[Supervisor, EnginePool]:
        pool = EnginePool()
        sup = Supervisor(cfg, pool, session, commands={"sim": fake_command},
                         run_dir=tmp_path / "run")
        made.append(sup)
        return sup, pool

    yield _make
    for sup in made:  # also after a failure: no process may outlive its test
        await sup.stop(grace_s=0)


async def until(pool: EnginePool, pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    assert await wait_for(pool, pred, timeout_s), "condition not met in time"


async def test_ready_metrics_logs_and_stop(make: Any, tmp_path: Path) -> None:
    sup, pool = make(config({"name": "a", "args": ["--child-pid-file", str(tmp_path / "c")]}))
    await sup.start()
    (engine,) = pool.engines
    assert engine.id == "a" and engine.state is EngineState.STARTING
    assert await sup.wait_ready(15)
    await until(pool, lambda: engine.metrics is not None)
    # 100 blocks exported; the engine's own token capacity (kv_cache_size_tokens) is
    # 99 × 16, vLLM keeping one null block, and that is what the gateway counts
    assert engine.metrics.block_size == 16 and engine.metrics.num_blocks == 99
    assert (tmp_path / "run" / "a.log").exists()
    pid, child = sup.runners[0].process.pid, int((tmp_path / "c").read_text())
    assert alive(pid) and alive(child)
    await sup.stop(grace_s=1)
    assert engine.state is EngineState.STOPPED
    assert not alive(pid) and not alive(child)


async def test_replicas_get_ids_and_ports_from_range(make: Any) -> None:
    first = free_port()
    sup, pool = make(config({"name": "r", "replicas": 2, "port_range": [first, first + 20]}))
    await sup.start()
    assert [e.id for e in pool.engines] == ["r-0", "r-1"]
    ports = [int(e.base_url.rsplit(":", 1)[1]) for e in pool.engines]
    assert len(set(ports)) == 2 and all(first <= p <= first + 20 for p in ports)
    assert await sup.wait_ready(15)
    await sup.stop(grace_s=1)


async def test_sigkill_restarts_with_new_generation(make: Any, tmp_path: Path) -> None:
    sup, pool = make(config({"name": "a", "args": ["--child-pid-file", str(tmp_path / "c")]}))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    rec = Recorder(pool, engine)
    old_pid, old_child = sup.runners[0].process.pid, int((tmp_path / "c").read_text())
    os.kill(old_pid, signal.SIGKILL)
    await until(pool, lambda: len(rec.states) > 1, 2)  # noticed at once, not by probes
    assert await sup.wait_ready(15)
    assert rec.names == ["ready", "unhealthy", "restarting", "starting", "ready"]
    assert (engine.generation, engine.restarts) == (1, 1)
    assert sup.runners[0].process.pid != old_pid
    assert not alive(old_child)  # the orphaned grandchild went with its group
    await sup.stop(grace_s=1)


async def test_backoff_grows_and_max_restarts_is_honoured(make: Any) -> None:
    sup, pool = make(config({"name": "a", "args": ["--exit-after", "0"]},
                            max_restarts=3, restart_backoff_s=0.2, restart_backoff_max_s=5))
    await sup.start()
    (engine,) = pool.engines
    rec = Recorder(pool, engine)
    await until(pool, lambda: engine.state is EngineState.STOPPED, 20)
    assert engine.restarts == 3 and engine.generation == 3
    restarting = [t for t, s in rec.states if s is EngineState.RESTARTING]
    relaunch = [t for t, s in rec.states[1:] if s is EngineState.STARTING]
    assert len(restarting) == len(relaunch) == 3
    waits = [b - a for a, b in zip(restarting, relaunch, strict=True)]
    for got, want in zip(waits, [0.2, 0.4, 0.8], strict=True):
        assert want - 0.02 <= got < want + 0.5
    assert not await sup.wait_ready(1)
    await sup.stop(grace_s=1)


async def test_failed_probes_mark_unhealthy_then_recover(make: Any, tmp_path: Path) -> None:
    flag = tmp_path / "fail"
    sup, pool = make(config({"name": "a", "args": ["--health-fail-file", str(flag)]},
                            failure_threshold=3))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    flag.touch()
    await until(pool, lambda: engine.state is EngineState.UNHEALTHY, 3)
    flag.unlink()
    await until(pool, lambda: engine.state is EngineState.READY, 3)
    assert engine.generation == 0  # recovered without a restart
    flag.touch()  # now for good: 2 × threshold failures → restart
    await until(pool, lambda: engine.generation == 1, 5)
    flag.unlink()
    assert await sup.wait_ready(15)
    await sup.stop(grace_s=1)


async def test_busy_engine_making_progress_stays_ready(
    make: Any, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    flag = tmp_path / "fail"
    sup, pool = make(config({"name": "a", "args": ["--health-fail-file", str(flag),
                                                   "--completion-delay", "2"]}))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    rec = Recorder(pool, engine)
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    busy = asyncio.create_task(session.post(f"{engine.base_url}/v1/completions", json=body))
    await until(pool, lambda: engine.metrics is not None and engine.metrics.num_running == 1)
    flag.touch()
    await support.wait_for(lambda: len(flag.read_text().splitlines()) >= 4, 5,
                           "2 × threshold failed /health probes")
    assert rec.names == ["ready"]  # the metrics kept moving: no probe counted as failed
    (await busy).release()
    await until(pool, lambda: engine.state is EngineState.UNHEALTHY, 3)
    flag.unlink()
    await sup.stop(grace_s=1)


async def test_idle_engine_gets_inference_probes(make: Any) -> None:
    sup, pool = make(config({"name": "a"}, inference_probe_idle_s=0.3))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    # each 1-token probe is one completion; the fake counts them as prefix queries
    await until(pool, lambda: engine.metrics is not None
                and engine.metrics.prefix_cache_queries >= 2, 5)
    assert engine.state is EngineState.READY
    await sup.stop(grace_s=1)


@pytest.mark.load
async def test_stop_drains_in_flight_requests_first(make: Any) -> None:
    sup, pool = make(config({"name": "a"}))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    pid = sup.runners[0].process.pid

    leased = asyncio.Event()

    async def request(hold_s: float) -> None:
        with pool.lease(engine):
            leased.set()
            await asyncio.sleep(hold_s)  # the request's own duration

    held = asyncio.create_task(request(0.8))
    await leased.wait()
    t0 = time.monotonic()
    stopping = asyncio.create_task(sup.stop(grace_s=5))
    await until(pool, lambda: engine.state is EngineState.DRAINING, 1)
    assert not engine.routable and alive(pid)
    await stopping
    assert held.done() and time.monotonic() - t0 >= 0.7
    assert engine.state is EngineState.STOPPED and not alive(pid)


@pytest.mark.load
async def test_drain_grace_bounds_the_wait(make: Any) -> None:
    sup, pool = make(config({"name": "a"}))
    await sup.start()
    (engine,) = pool.engines
    assert await sup.wait_ready(15)
    with pool.lease(engine):
        t0 = time.monotonic()
        await sup.stop(grace_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 3
    assert not alive(sup.runners[0].process.pid)


@pytest.mark.load
async def test_sigterm_ignored_then_sigkill(make: Any) -> None:
    sup, pool = make(config({"name": "a", "args": ["--ignore-sigterm"]}, stop_grace_s=0.5))
    await sup.start()
    assert await sup.wait_ready(15)
    proc = sup.runners[0].process
    t0 = time.monotonic()
    await sup.stop(grace_s=0)
    assert time.monotonic() - t0 >= 0.5
    assert proc.returncode == -signal.SIGKILL and not alive(proc.pid)


async def test_only_its_own_process_groups_are_signalled(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    foreign = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_engine", "--port", str(port), "--model", "m"],
        start_new_session=True,
    )
    signalled: list[int] = []
    real_killpg = os.killpg

    def spy(pgid: int, sig: int) -> None:
        signalled.append(pgid)
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", spy)
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail(f"os.kill{a}"))
    try:
        cfg = EnginesConfig.model_validate({
            "engines": [{"name": "ext", "model": "m", "kind": "external",
                         "url": f"http://127.0.0.1:{port}/v1"},
                        {"name": "own", "model": "m", "kind": "sim"}],
            "supervisor": FAST,
        })
        sup, pool = make(cfg)
        await sup.start()
        assert pool.get("ext").base_url == f"http://127.0.0.1:{port}"
        assert await sup.wait_ready(15)
        launched = {sup.runners[1].process.pid}
        real_killpg(sup.runners[1].process.pid, signal.SIGKILL)  # the test's own kill
        signalled.clear()
        await until(pool, lambda: pool.get("own").generation == 1, 5)
        assert await sup.wait_ready(15)
        launched.add(sup.runners[1].process.pid)
        await sup.stop(grace_s=1)
        assert signalled and set(signalled) <= launched
        assert foreign.poll() is None  # the external engine's process is untouched
    finally:
        monkeypatch.undo()
        foreign.kill()
        foreign.wait()


async def test_kind_without_command_is_rejected_before_anything_starts(
    session: aiohttp.ClientSession,
) -> None:
    pool = EnginePool()
    sup = Supervisor(config({"name": "a"}), pool, session, commands={})
    with pytest.raises(ValueError, match="sim"):
        await sup.start()
    assert pool.engines == []


async def test_failed_scrape_keeps_the_last_snapshot(session: aiohttp.ClientSession) -> None:
    pool = EnginePool()
    engine = Engine(id="gone", model="m", base_url=f"http://127.0.0.1:{free_port()}")
    engine.metrics = MetricsSnapshot(at=1.0, num_running=2)
    pool.add(engine)
    poller = MetricsPoller(pool, engine, session, interval_s=0.1, timeout_s=0.5)
    assert await poller.scrape_once() is None
    assert engine.metrics == MetricsSnapshot(at=1.0, num_running=2)
