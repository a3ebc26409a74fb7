"""Rate limits shared by three ``sluice serve`` processes on one Redis, under
concurrency: exact requests/min, tokens/min with streamed requests, concurrency
slots returned by cancelled streams, and a Redis outage (fail open, then shared
limits again)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp
import pytest
import redis

from tests.integration.limits_support import (
    auth,
    chat,
    check_rejection,
    gateways,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for

pytestmark = pytest.mark.timeout(120)

RPM = 20  # one request per 3 s after the burst: a burst decided within 3 s is exact
TPM = 3000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server):
    """Three gateway processes, each with its own simulated engine, sharing Redis."""
    cfg = write_config(
        tmp_path_factory.mktemp("races"),
        tenants=[tenant("rpm", requests_per_min=RPM),
                 tenant("tpm", tokens_per_min=TPM),
                 tenant("one", max_concurrent=1),
                 tenant("outage", requests_per_min=RPM),
                 *(tenant(f"probe{i}", requests_per_min=60) for i in range(3))],
        engines=[sim_engine(speed=50.0)],
        gateway={"limits": {"store_url": redis_server.url}},
        saturation={"max_waiting": 1000},
    )
    if redis_server.proc is None:
        redis_server.start()
    with gateways(cfg, 3) as procs:
        yield [g.url for g in procs]


def flush(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()


async def send(session: aiohttp.ClientSession, url: str, name: str, body: dict,
               ) -> tuple[int, dict, object]:
    async with session.post(url + "/v1/chat/completions", json=body, headers=auth(name)) as r:
        if r.status == 200 and body.get("stream"):
            usage = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    obj = json.loads(line[6:])
                    usage = obj.get("usage") or usage
            return r.status, dict(r.headers), {"usage": usage}
        return r.status, dict(r.headers), await r.json(content_type=None)


async def burst(urls: list[str], name: str, n: int, clients: int = 64, *,
                body: dict | None = None) -> list[tuple[int, dict, object]]:
    """``n`` requests from ``clients`` concurrent clients, round-robin over ``urls``."""
    todo = iter(range(n))
    out: list[tuple[int, dict, object]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        for i in todo:
            out.append(await send(session, urls[i % len(urls)], name, body or chat()))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return out


def tally(results: list[tuple[int, dict, object]]) -> tuple[int, int]:
    ok = sum(s == 200 for s, _, _ in results)
    for status, headers, body in results:
        if status != 200:
            assert status == 429, (status, body)
            assert check_rejection(status, headers, body) == "rate_limit_exceeded"
    return ok, len(results) - ok


@pytest.mark.load
async def test_requests_per_min_exact_across_three_gateways(cluster, redis_server) -> None:
    flush(redis_server)
    t0 = time.monotonic()
    results = await burst(cluster, "rpm", 128)
    elapsed = time.monotonic() - t0
    assert elapsed < 60 / RPM, "burst too slow for an exact count"
    ok, rejected = tally(results)
    assert (ok, rejected) == (RPM, 128 - RPM)
    assert all(int(h["Retry-After"]) <= 60 / RPM + 1 for s, h, _ in results if s == 429)


@pytest.mark.load
async def test_tokens_per_min_concurrent_streams_never_overshoot(cluster, redis_server) -> None:
    flush(redis_server)
    body = chat("tell me a long story about rivers and the sea " * 4, 60, stream=True)
    t0 = time.monotonic()
    results = await burst(cluster, "tpm", 96, body=body)
    elapsed = time.monotonic() - t0
    ok, _ = tally(results)
    assert ok > 0
    used = [b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"]
            for s, _, b in results if s == 200]
    # one request's reservation: the gateway's prompt estimate + max_tokens; the
    # engine's count of the prompt is within a few tokens of that estimate
    reservation = max(used) + 8
    refill = TPM / 60 * elapsed  # GCRA refills continuously
    assert sum(used) <= TPM + refill + reservation, (sum(used), len(used), elapsed)
    # and the budget was really used, not refused wholesale
    assert sum(used) >= TPM - 2 * reservation


@pytest.mark.load
async def test_cancelled_stream_returns_concurrency_slot(cluster, redis_server) -> None:
    flush(redis_server)
    long = chat("hello", 2000, stream=True)
    async with aiohttp.ClientSession() as session:
        for first, second in itertools.islice(itertools.permutations(cluster, 2), 3):
            resp = await session.post(first + "/v1/chat/completions", json=long,
                                      headers=auth("one"))
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # streaming: the slot is held
            status, headers, body = await send(session, second, "one", chat())
            assert status == 429 and check_rejection(status, headers, body) == "rate_limit_exceeded"
            resp.close()  # client goes away mid-stream
            t0 = time.monotonic()

            async def served(second: str = second) -> bool:
                status, _, _ = await send(session, second, "one", chat())
                return status == 200

            await wait_for(served, 5, "the slot to come back", poll_s=0.02)
            assert time.monotonic() - t0 < 0.5  # returned at once, not after a lease TTL


async def wait_shared(urls: list[str], redis_server) -> None:
    """Until every gateway writes its counters to Redis again (its failover probe
    found Redis back)."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        async with aiohttp.ClientSession() as session:
            for i, url in enumerate(urls):
                async def shared(i: int = i, url: str = url) -> bool:
                    status, _, _ = await send(session, url, f"probe{i}", chat())
                    assert status in (200, 429)  # a key lives ~1 s after a request
                    return bool(client.exists(f"sluice:{{probe{i}}}:rpm"))

                await wait_for(shared, 15, f"gateway {i} to go back to Redis", poll_s=0.2)
    finally:
        client.close()


async def test_redis_outage_fails_open_then_limits_resume(cluster, redis_server) -> None:
    flush(redis_server)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def steady() -> None:
        while not stop.is_set():
            statuses.extend(s for s, _, _ in await burst(cluster, "outage", 12, clients=6))
            await asyncio.sleep(0.05)

    traffic = asyncio.create_task(steady())
    await wait_for(lambda: len(statuses) >= 12, what="traffic to flow")
    redis_server.stop()
    try:
        during = len(statuses)
        # two more bursts answered while Redis is down
        await wait_for(lambda: len(statuses) >= during + 24, 10, "traffic during the outage")
        results = await burst(cluster, "rpm", 30, clients=8)  # fresh tenant while down
        assert all(s in (200, 429) for s, _, _ in results)
        # each replica falls back to its own local limiter: served, never a 500
        assert sum(s == 200 for s, _, _ in results) > 0
        assert len(statuses) > during
    finally:
        redis_server.start()
    after = len(statuses)
    await wait_for(lambda: len(statuses) >= after + 12, 10, "traffic after Redis came back")
    stop.set()
    await traffic
    assert set(statuses) <= {200, 429}, set(statuses)
    await wait_shared(cluster, redis_server)
    flush(redis_server)
    ok, _ = tally(await burst(cluster, "rpm", 96))
    assert ok == RPM  # shared across the three replicas again, not 3 × RPM
