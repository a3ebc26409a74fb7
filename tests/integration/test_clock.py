"""The app's one injected clock: the engine client measures TTFT with it, every
request record is stamped with it, and the engines' metrics snapshots carry it (so
placement compares like with like)."""

from __future__ import annotations

import time

import aiohttp

from config.schema import Timeouts
from engines.pool import Engine
from gateway.app import create_app
from gateway.keys import OBSERVERS
from gateway.openai_api import parse_request
from gateway.proxy import EngineClient
from gateway.record import RequestRecord
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT
from tests.support import ManualClock, wait_for

#: Far from any real monotonic reading (31 years).
OFFSET_S = 1e9


class OffsetClock:
    """Real time, shifted by :data:`OFFSET_S`: readings no other clock could give."""

    def now(self) -> float:
        return time.monotonic() + OFFSET_S


async def test_engine_client_measures_ttft_on_its_clock(engines) -> None:
    (fake,) = await engines(1, mode="slow_first", delay_s=0.05)  # 50 ms the clock ignores
    clock = ManualClock(step=0.25)  # every reading moves it 0.25 s
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, Timeouts(), max_event_bytes=1 << 20, clock=clock)
        req = parse_request("chat", dict(CHAT))
        engine = Engine(id="e0", model=fake.model, base_url=fake.url)
        # a JSON answer is not relayed through the client's request: none needed
        result = await client.send(engine, req, None, {})  # type: ignore[arg-type]
    assert result.ttft_s == 0.25  # sent at one reading, answered at the next


async def test_records_and_metrics_carry_the_app_clock(engines) -> None:
    (fake,) = await engines(1)
    cfg = make_config([fake])
    records: list[RequestRecord] = []
    app = create_app(cfg, clock=OffsetClock())
    app[OBSERVERS].append(records.append)
    async with run_gateway(cfg, app=app) as gw:
        engine = gw.pool.engines[0]
        await wait_for(lambda: engine.metrics is not None, what="a metrics scrape")
        assert engine.metrics.at > OFFSET_S  # the supervisor's scrapes
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 200
        await gw.idle()
    (rec,) = records
    assert rec.started > OFFSET_S
    assert 0 < rec.ttft_s <= rec.duration_s < 10
