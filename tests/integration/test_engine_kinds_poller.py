"""The metrics poller and probes against simulated dialects over loopback HTTP: the
dialect's endpoint and parser, an engine without ``/metrics`` marked unmetered, the
missing-signals log line, the health and chat-only inference probes; the part of
the reported load that is the gateway's own when a request ends during a scrape."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from engines.health import probe_inference, probe_ready
from engines.kinds import KINDS
from engines.metrics import MetricsPoller
from engines.plugins import engine_load
from engines.pool import Engine, EnginePool
from loadtest.sim_engine import SimEngine, get_profile, serve
from tests.conftest import free_port
from tests.support import ManualClock

MODEL = "sim-test"


@pytest.fixture
async def sim_at():
    """Start a simulator in a dialect; yields a function ``dialect -> base URL``."""
    runners = []

    async def start(dialect: str) -> str:
        port = free_port()
        engine = SimEngine(get_profile("cpu-gemma3-270m-quiet"), MODEL, speed=20.0)
        runners.append(await serve(engine, "127.0.0.1", port, dialect=dialect))
        return f"http://127.0.0.1:{port}"

    yield start
    for r in runners:
        await r.cleanup()


async def _poll_once(url: str, dialect: str) -> tuple[Engine, object]:
    engine = Engine(id="e", model=MODEL, base_url=url)
    async with aiohttp.ClientSession() as session:
        poller = MetricsPoller(EnginePool([engine]), engine, session, interval_s=1,
                               timeout_s=2, clock=ManualClock(5.0), kind=KINDS[dialect])
        snap = await poller.scrape_once()
    return engine, snap


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp", "sglang", "tgi", "trtllm"])
async def test_poller_reads_each_dialect(sim_at, dialect: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="engines.metrics")
    engine, snap = await _poll_once(await sim_at(dialect), dialect)
    assert snap is not None and engine.metrics is snap and snap.at == 5.0
    assert engine.metered and snap.signals == KINDS[dialect].signals
    missing = [r for r in caplog.records if "signal(s)" in r.getMessage()]
    if dialect in ("vllm", "sglang", "trtllm"):
        assert not missing
    else:  # llama.cpp and TGI have no KV usage: said once, at INFO (expected for them)
        (record,) = missing
        assert record.levelno == logging.INFO and "kv_usage" in record.getMessage()


async def test_engine_without_metrics_is_unmetered_and_logged(sim_at, caplog) -> None:
    """An external engine assumed to speak vLLM's dialect whose /metrics is 404."""
    caplog.set_level(logging.INFO, logger="engines.metrics")
    engine, snap = await _poll_once(await sim_at("openai"), "vllm")
    assert snap is None and engine.metrics is None and not engine.metered
    (record,) = [r for r in caplog.records if "signal(s)" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "in-flight accounting and latency observations" in record.getMessage()


async def test_llamacpp_slots_read_once_per_generation(sim_at) -> None:
    """llama.cpp's ``/props`` ``total_slots`` (the simulator's ``max_num_seqs``)
    becomes ``Engine.slots``, read again after a restart (a new generation); other
    dialects have no slot count."""
    engine, _ = await _poll_once(await sim_at("llamacpp"), "llamacpp")
    assert engine.slots == get_profile("cpu-gemma3-270m-quiet").max_num_seqs
    async with aiohttp.ClientSession() as session:
        poller = MetricsPoller(EnginePool([engine]), engine, session, interval_s=1,
                               timeout_s=2, kind=KINDS["llamacpp"])
        engine.slots = None
        assert await poller.read_slots() == engine.slots == \
            get_profile("cpu-gemma3-270m-quiet").max_num_seqs
        engine.slots = 1  # not read again within one generation
        assert await poller.read_slots() == 1
        engine.generation += 1
        assert await poller.read_slots() == get_profile("cpu-gemma3-270m-quiet").max_num_seqs
    tgi, _ = await _poll_once(await sim_at("tgi"), "tgi")
    assert tgi.slots is None


async def test_wrong_dialect_page_warns(sim_at, caplog) -> None:
    """vLLM's parser on a TGI page finds none of its names: unmetered, WARNING."""
    caplog.set_level(logging.INFO, logger="engines.metrics")
    engine, snap = await _poll_once(await sim_at("tgi"), "vllm")
    assert snap is not None and snap.signals == frozenset() and not engine.metered
    assert any(r.levelno == logging.WARNING for r in caplog.records)


async def test_probes_of_a_chat_only_server_without_health(sim_at) -> None:
    url = await sim_at("openai")
    async with aiohttp.ClientSession() as session:
        assert await probe_ready(session, url, MODEL, 2.0)  # /health 404: /v1/models decides
        assert not await probe_ready(session, url, "other-model", 2.0)
        assert await probe_inference(session, url, MODEL, 5.0)  # completions 404 → chat
        assert await probe_inference(session, url, MODEL, 5.0, "chat")
        dead = f"http://127.0.0.1:{free_port()}"
        assert not await probe_inference(session, dead, MODEL, 1.0)


async def test_a_request_that_ends_during_the_scrape_is_not_counted_as_another_clients(
        ) -> None:
    """The engine's page is written while this gateway's one request still runs; the
    request ends before the page arrives. The report's one running request is this
    gateway's own, not another client's: the engine's load is 0, not 1 (a phantom
    request that would hold the engine's only slot until the next scrape)."""
    engine = Engine(id="e", model=MODEL, base_url="")
    pool = EnginePool([engine])
    lease = pool.lease(engine)
    page_written = asyncio.Event()
    released = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        text = (f'vllm:num_requests_running{{model_name="{MODEL}"}} 1\n'
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n')
        page_written.set()
        await released.wait()
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engine.base_url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            poller = MetricsPoller(pool, engine, session, interval_s=1, timeout_s=2,
                                   clock=ManualClock(5.0), kind=KINDS["vllm"])
            scrape = asyncio.ensure_future(poller.scrape_once())
            await page_written.wait()
            lease.release()  # the request ends while the page is on its way
            released.set()
            snap = await scrape
    finally:
        await runner.cleanup()
    assert snap is not None and snap.num_running == 1 and engine.in_flight == 0
    assert engine_load(engine) == 0
