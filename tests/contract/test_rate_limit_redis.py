"""RateLimiter across three "replicas" (own Redis connections) sharing one Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from config.schema import TenantQuota
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter
from limits.stores import open_store
from tests.conftest import RedisServer


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[list[RateLimiter]]:
    # a generous timeout: these tests are about atomicity across replicas, and a slow
    # reply on a busy machine must not fail over to the local limiter (outages are
    # tested in test_redis_store_outage.py)
    stores = [open_store(redis_url, timeout_s=5) for _ in range(3)]
    yield [RateLimiter(s) for s in stores]
    for s in stores:
        await s.close()


async def test_exactly_n_requests_across_replicas(replicas: list[RateLimiter]) -> None:
    t = TenantQuota(name="acme", requests_per_min=25)
    outcomes = await asyncio.gather(
        *(replicas[i % 3].reserve(t, 1, request_id=str(i)) for i in range(64)),
        return_exceptions=True,
    )
    rejected = [o for o in outcomes if isinstance(o, Rejected)]
    assert len(outcomes) - len(rejected) == 25
    assert {r.reason for r in rejected} == {"requests_per_min"}


async def test_tokens_never_overshoot_across_replicas(replicas: list[RateLimiter]) -> None:
    t = TenantQuota(name="acme", tokens_per_min=10_000)

    async def stream(i: int) -> int:
        try:
            async with await replicas[i % 3].reserve(t, 700, request_id=str(i)) as r:
                await asyncio.sleep(0.01)
                await r.settle(700)
                return 700
        except Rejected:
            return 0

    served = await asyncio.gather(*(stream(i) for i in range(64)))
    assert sum(served) == 14 * 700  # ≤ 10 000 < 15 × 700


async def test_cancelled_stream_returns_its_slot(replicas: list[RateLimiter]) -> None:
    t = TenantQuota(name="acme", max_concurrent=1)
    started = asyncio.Event()

    async def stream() -> None:
        async with await replicas[0].reserve(t, 0, request_id="s"):
            started.set()
            await asyncio.Event().wait()  # a stream that lasts until cancelled

    task = asyncio.create_task(stream())
    await started.wait()
    with pytest.raises(Rejected):
        await replicas[1].reserve(t, 0, request_id="blocked")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await replicas[2].reserve(t, 0, request_id="next")  # at once, on another replica


async def test_fail_closed_rejects_with_overloaded(
    redis_url: str, redis_server: RedisServer
) -> None:
    store = open_store(redis_url, failure="closed")
    limiter = RateLimiter(store)
    t = TenantQuota(name="acme", requests_per_min=100, max_concurrent=5)
    try:
        redis_server.stop()
        with pytest.raises(Rejected) as exc:
            await limiter.reserve(t, 0, request_id="x")
        assert exc.value.outcome is Outcome.OVERLOADED and exc.value.retry_after_s
    finally:
        redis_server.start()
        await store.close()
