"""``Reservation.refund`` (issue 39 item 6) against ``memory://`` (a hand-driven clock)
and a real Redis: a request the service refused itself gives back its request and
its tokens, once, and a settled reservation gives back nothing more."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from config.schema import TenantQuota
from limits.interfaces import CounterStore
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter
from limits.stores import open_store
from tests.support import ManualClock

TENANT = TenantQuota(name="t", requests_per_min=2, tokens_per_min=100)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[CounterStore]:
    s = (open_store("memory://", clock=ManualClock()) if request.param == "memory"
         else open_store(request.getfixturevalue("redis_url")))
    yield s
    await s.close()


async def denied(limiter: RateLimiter, tokens: int) -> str | None:
    try:
        r = await limiter.reserve(TENANT, tokens, request_id="probe")
    except Rejected as e:
        assert e.outcome is Outcome.RATE_LIMITED
        return e.reason
    await r.settle(tokens)
    return None


async def test_a_refund_returns_the_request_and_its_tokens(store: CounterStore) -> None:
    limiter = RateLimiter(store)
    for _ in range(5):  # five refused by the service, each refunded: nothing owed
        async with await limiter.reserve(TENANT, 90, request_id="r") as r:
            await r.refund()
            await r.refund()  # once only
            await r.settle(90)  # after a refund: nothing
    # the whole minute is still there: 2 requests, and 90 + 10 tokens
    assert await denied(limiter, 90) is None
    assert await denied(limiter, 10) is None
    assert await denied(limiter, 1) == "requests_per_min"


async def test_a_settled_reservation_is_not_refunded(store: CounterStore) -> None:
    limiter = RateLimiter(store)
    async with await limiter.reserve(TENANT, 60, request_id="r") as r:
        await r.settle(60)
        await r.refund()
    assert await denied(limiter, 45) == "tokens_per_min"  # 40 left (Redis: ~1.7/s back)
    assert await denied(limiter, 40) is None
    assert await denied(limiter, 1) == "requests_per_min"
    assert Outcome.QUEUE_TIMEOUT.refunded and Outcome.NO_ENGINE.refunded \
        and Outcome.OVERLOADED.refunded
    assert not Outcome.RATE_LIMITED.refunded and not Outcome.UPSTREAM_ERROR.refunded
