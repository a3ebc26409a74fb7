"""Overload: ``sluice serve`` with two simulated engines, offered three times what
they sustain (measured first, closed loop), open loop. The gateway's backlog stays
bounded (requests open at the client ≤ queue bound + engine slots), its RSS stays
bounded, and every rejection is a well-formed 429/503 with an integer
``Retry-After`` — never a 500."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import psutil
import pytest

from tests.integration.limits_support import (
    auth,
    chat,
    check_rejection,
    gateways,
    sim_engine,
    tenant,
    write_config,
)

# load: fixed-duration overload traffic (3 s and 10 s)
pytestmark = [pytest.mark.timeout(150), pytest.mark.load]

ENGINES, SLOTS, QUEUE_MAX = 2, 4, 24
TENANTS = ("chat", "std", "bulk", "capped")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory):
    cfg = write_config(
        tmp_path_factory.mktemp("overload"),
        tenants=[tenant("chat", priority="interactive", max_queue_wait_s=2),
                 tenant("std", max_queue_wait_s=3),
                 tenant("bulk", priority="batch", max_queue_wait_s=5),
                 tenant("capped", requests_per_min=30)],
        engines=[sim_engine(speed=5.0, replicas=ENGINES)],
        gateway={"queue": {"max_requests": QUEUE_MAX, "default_max_wait_s": 3}},
        saturation={"max_in_flight": SLOTS, "max_waiting": 1000},
    )
    with gateways(cfg, 1) as (gw,):
        yield gw


def body(rng: random.Random) -> dict:
    return chat("the river runs to the sea " * rng.randint(5, 30), rng.randint(8, 32))


async def post(session: aiohttp.ClientSession, url: str, name: str, b: dict) -> tuple:
    async with session.post(url + "/v1/chat/completions", json=b, headers=auth(name)) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_three_times_capacity(gateway) -> None:
    rng = random.Random(7)
    proc = psutil.Process(gateway.proc.pid)
    url = gateway.url
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # capacity: what the engines sustain with every slot busy
        done = 0
        end = time.monotonic() + 3.0

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                status, _, data = await post(session, url, "std", body(rng))
                assert status == 200, data
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(ENGINES * SLOTS)))
        capacity = done / (time.monotonic() - t0)
        rate = 3 * capacity

        open_now = peak_open = 0
        rss: list[float] = []
        results: list[tuple] = []

        async def one(name: str) -> None:
            nonlocal open_now, peak_open
            open_now += 1
            peak_open = max(peak_open, open_now)
            try:
                results.append(await post(session, url, name, body(rng)))
            finally:
                open_now -= 1

        tasks = []
        t0 = time.monotonic()
        next_rss = t0
        while (now := time.monotonic()) - t0 < 10.0:
            if now >= next_rss:
                rss.append(proc.memory_info().rss / 2**20)
                next_rss += 0.5
            tasks.append(asyncio.create_task(one(rng.choice(TENANTS))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        rss.append(proc.memory_info().rss / 2**20)

    codes: dict[str, int] = {}
    for status, headers, data in results:
        if status != 200:
            assert status in (429, 503), (status, data)
            code = check_rejection(status, headers, data)
            codes[code] = codes.get(code, 0) + 1
    served = sum(s == 200 for s, _, _ in results)
    assert len(results) > 2.5 * capacity * 10 * 0.8, (len(results), capacity)
    assert codes.get("rate_limit_exceeded"), codes  # the capped tenant hit its limit
    assert sum(codes.values()) > len(results) / 3, codes  # overload was shed …
    assert served > 0.8 * capacity * 10, (served, capacity)  # … while the engines stayed busy
    # every open request is queued (≤ bound), on an engine (≤ slots) or on its way
    assert peak_open <= QUEUE_MAX + ENGINES * SLOTS + 8, peak_open
    half = len(rss) // 2
    assert max(rss[half:]) - max(rss[:half]) < 20, rss
    assert max(rss) < 400, rss
