"""Fair share and priority through a ``sluice serve`` process whose simulated engine
is saturated (the gateway keeps at most ``max_in_flight`` requests on it, so the
rest wait in the admission queue):

* two tenants of weights 3 and 1 in one priority band, both backlogged → served
  tokens 3:1 ± 10 %;
* interactive requests keep a short queue wait while a batch tenant floods.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest

from tests.integration.limits_support import (
    auth,
    chat,
    check_rejection,
    gateways,
    queue_depth,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for

# load: fixed-duration closed-loop traffic (10 s, 8 s)
pytestmark = [pytest.mark.timeout(120), pytest.mark.load]

PROMPT = "the river runs to the sea and the sea is never full " * 8  # ~100 tokens
INTERACTIVE_BOUND_S = 1.0


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory):
    cfg = write_config(
        tmp_path_factory.mktemp("fairness"),
        tenants=[tenant("heavy", weight=3, max_queue_wait_s=60),
                 tenant("light", weight=1, max_queue_wait_s=60),
                 tenant("chat", priority="interactive", max_queue_wait_s=INTERACTIVE_BOUND_S),
                 tenant("bulk", priority="batch", max_queue_wait_s=60)],
        engines=[sim_engine(speed=20.0)],
        # the backlog is the point here: queued standard and batch tickets wait longer
        # than their default TTFT targets, which would shed them as predicted misses
        gateway={"queue": {"quantum_tokens": 256},
                 "slo": {"standard": {"ttft_s": 120, "tpot_s": 0.1},
                         "batch": {"ttft_s": 120, "tpot_s": 0.1}}},
        saturation={"max_in_flight": 4, "max_waiting": 1000},
    )
    with gateways(cfg, 1) as (gw,):
        yield gw.url


async def post(session: aiohttp.ClientSession, url: str, name: str, body: dict) -> tuple:
    async with session.post(url + "/v1/chat/completions", json=body, headers=auth(name)) as r:
        data = await r.json(content_type=None)
        return r.status, dict(r.headers), data, time.monotonic()


async def closed_loop(session, url: str, name: str, clients: int, until: float,
                      body: dict, out: list) -> None:
    async def one() -> None:
        while time.monotonic() < until:
            out.append((name, *await post(session, url, name, body)))

    await asyncio.gather(*(one() for _ in range(clients)))


async def test_weighted_fair_share_3_to_1(gateway_url: str) -> None:
    results: list[tuple] = []
    start = time.monotonic()
    end = start + 10.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(
            closed_loop(session, gateway_url, "heavy", 16, end, chat(PROMPT, 24), results),
            closed_loop(session, gateway_url, "light", 16, end, chat(PROMPT, 24), results))
    # both stay backlogged (16 clients each, 4 slots) until the first clients stop
    lo, hi = start + 1.0, end - 0.5
    served = {"heavy": 0, "light": 0}
    for name, status, _, body, at in results:
        assert status == 200, body
        if lo <= at <= hi:
            usage = body["usage"]
            served[name] += usage["prompt_tokens"] + usage["completion_tokens"]
    assert served["light"] > 0
    ratio = served["heavy"] / served["light"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, (ratio, served)


async def test_interactive_queue_wait_bounded_while_batch_floods(gateway_url: str) -> None:
    flood: list[tuple] = []
    interactive: list[tuple] = []
    end = time.monotonic() + 8.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def chat_user() -> None:
            async def backlog() -> bool:  # let the batch backlog build first
                return await queue_depth(session, gateway_url, priority="batch") >= 30

            await wait_for(backlog, 5, "the batch backlog", poll_s=0.05)
            tasks = []
            while time.monotonic() < end - 1.0:
                tasks.append(asyncio.create_task(
                    post(session, gateway_url, "chat", chat(PROMPT, 24))))
                await asyncio.sleep(0.1)
            interactive.extend(await asyncio.gather(*tasks))

        await asyncio.gather(
            closed_loop(session, gateway_url, "bulk", 48, end, chat(PROMPT, 24), flood),
            chat_user())
    waits = []
    for status, headers, body, _ in interactive:
        assert status == 200, body
        waits.append(float(headers["x-sluice-queue-ms"]) / 1000)
    assert len(waits) >= 40
    p99 = float(np.percentile(waits, 99))
    assert p99 < INTERACTIVE_BOUND_S / 2, waits
    batch_waits = []
    for _, status, headers, body, _ in flood:
        if status == 200:
            batch_waits.append(float(headers["x-sluice-queue-ms"]) / 1000)
        else:
            assert status == 503 and check_rejection(status, headers, body)
    # the flood really queued: batch waited far longer than interactive
    assert np.median(batch_waits) > 5 * np.median(waits), (np.median(batch_waits), waits)
