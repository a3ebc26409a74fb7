"""RateLimiter over the in-process store with a hand-driven clock."""

from __future__ import annotations

import asyncio

import pytest

from config.schema import TenantQuota
from limits.clock import MonotonicClock
from limits.memory_store import MemoryStore
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def limiter(clock: ManualClock) -> RateLimiter:
    return RateLimiter(MemoryStore(clock))


def tenant(**limits: int) -> TenantQuota:
    return TenantQuota(name="acme", **limits)


async def rejection(coro) -> Rejected:  # type: ignore[no-untyped-def]
    with pytest.raises(Rejected) as exc:
        await coro
    assert exc.value.outcome is Outcome.RATE_LIMITED
    return exc.value


async def test_exactly_n_requests_of_n_plus_k(limiter: RateLimiter, clock: ManualClock) -> None:
    t = tenant(requests_per_min=5)
    admitted, rejected = 0, []
    for i in range(8):
        try:
            await limiter.reserve(t, 10, request_id=str(i))
            admitted += 1
        except Rejected as e:
            rejected.append(e)
    assert admitted == 5 and len(rejected) == 3
    assert {e.reason for e in rejected} == {"requests_per_min"}
    assert "5 requests per minute" in rejected[0].message
    assert rejected[0].retry_after_s == pytest.approx(12)  # one request per 60/5 s
    clock.t += 12
    await limiter.reserve(t, 10, request_id="later")
    await rejection(limiter.reserve(t, 10, request_id="too-soon"))


async def test_tokens_per_min_and_retry_after(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000)
    await limiter.reserve(t, 400, request_id="a")
    await limiter.reserve(t, 400, request_id="b")
    e = await rejection(limiter.reserve(t, 400, request_id="c"))
    assert e.reason == "tokens_per_min" and "1000 tokens per minute" in e.message
    assert e.retry_after_s == pytest.approx(12)  # 200 missing tokens at 1000/60 per s
    await limiter.reserve(t, 200, request_id="fits")


async def test_request_larger_than_the_budget_is_rejected_up_front(limiter: RateLimiter) -> None:
    e = await rejection(limiter.reserve(tenant(tokens_per_min=100), 101, request_id="x"))
    assert e.reason == "tokens_per_min" and "lower max_tokens" in e.message


async def test_settle_refunds_unused_tokens(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000)
    r = await limiter.reserve(t, 600, request_id="a")
    await r.settle(100)
    await limiter.reserve(t, 900, request_id="b")
    await rejection(limiter.reserve(t, 1, request_id="c"))


async def test_settle_charges_extra_usage(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000)
    r = await limiter.reserve(t, 100, request_id="a")
    await r.settle(600)
    await limiter.reserve(t, 400, request_id="b")
    await rejection(limiter.reserve(t, 1, request_id="c"))


async def test_first_settle_wins(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000)
    r = await limiter.reserve(t, 500, request_id="a")
    await r.settle(0)
    await r.settle(1000)  # ignored
    async with r:  # exit must not settle again either
        pass
    await limiter.reserve(t, 1000, request_id="b")


async def test_exit_without_settle_keeps_the_reservation(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000, max_concurrent=1)
    async with await limiter.reserve(t, 600, request_id="a") as r:
        assert not r.settled
    assert r.settled and r.released
    await rejection(limiter.reserve(t, 500, request_id="b"))
    await limiter.reserve(t, 400, request_id="c")  # and the slot came back


async def test_concurrency_slots_and_idempotent_release(limiter: RateLimiter) -> None:
    t = tenant(max_concurrent=2)
    a = await limiter.reserve(t, 0, request_id="a")
    await limiter.reserve(t, 0, request_id="b")
    e = await rejection(limiter.reserve(t, 0, request_id="c"))
    assert e.reason == "concurrency" and e.retry_after_s == 1.0
    await a.release()
    await a.release()  # releasing twice frees one slot, not two
    await limiter.reserve(t, 0, request_id="c")
    await rejection(limiter.reserve(t, 0, request_id="d"))


async def test_same_request_id_cannot_share_a_slot(limiter: RateLimiter) -> None:
    t = tenant(max_concurrent=1)
    await limiter.reserve(t, 0, request_id="client-chosen")
    await rejection(limiter.reserve(t, 0, request_id="client-chosen"))


async def test_rejected_tokens_leave_requests_and_slot_untaken(limiter: RateLimiter) -> None:
    t = tenant(requests_per_min=3, tokens_per_min=100, max_concurrent=1)
    r = await limiter.reserve(t, 100, request_id="a")
    await r.release()
    for i in range(5):
        e = await rejection(limiter.reserve(t, 50, request_id=f"x{i}"))
        assert e.reason == "tokens_per_min"
    # neither the 5 request counts nor the concurrency slot stayed taken
    await limiter.reserve(t, 0, request_id="b")
    await rejection(limiter.reserve(t, 0, request_id="c"))  # slot held by b
    await limiter.reserve(t, 0, request_id="d", concurrency=False)  # 3rd request


async def test_rejected_concurrency_takes_no_request(limiter: RateLimiter) -> None:
    t = tenant(requests_per_min=2, max_concurrent=1)
    held = await limiter.reserve(t, 0, request_id="a")
    for i in range(5):
        assert (await rejection(limiter.reserve(t, 0, request_id=f"x{i}"))).reason == (
            "concurrency")
    await held.release()
    await limiter.reserve(t, 0, request_id="b")
    third = limiter.reserve(t, 0, request_id="c", concurrency=False)
    assert (await rejection(third)).reason == "requests_per_min"


async def test_cache_hit_counts_one_request_and_no_tokens_or_slot(limiter: RateLimiter) -> None:
    t = tenant(requests_per_min=2, tokens_per_min=10, max_concurrent=1)
    await limiter.reserve(t, 10, request_id="streaming")  # all tokens and the slot
    hit = await limiter.reserve(t, 0, request_id="hit", concurrency=False)
    async with hit:
        pass
    e = await rejection(limiter.reserve(t, 0, request_id="third", concurrency=False))
    assert e.reason == "requests_per_min"


async def test_unlimited_tenant_is_never_limited(limiter: RateLimiter) -> None:
    for i in range(100):
        async with await limiter.reserve(tenant(), 10**6, request_id=str(i)):
            pass


async def test_concurrent_reservations_never_overshoot_tokens(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000)
    outcomes = await asyncio.gather(
        *(limiter.reserve(t, 90, request_id=str(i)) for i in range(64)),
        return_exceptions=True,
    )
    admitted = [o for o in outcomes if not isinstance(o, BaseException)]
    assert sum(r.tokens for r in admitted) == 990  # 11 × 90 ≤ 1000 < 12 × 90


async def test_held_lease_is_renewed_past_its_ttl() -> None:
    limiter = RateLimiter(MemoryStore(MonotonicClock()), lease_ttl_s=0.2)
    t = tenant(max_concurrent=1)
    async with await limiter.reserve(t, 0, request_id="long-stream"):
        await asyncio.sleep(0.5)  # 2.5 × the TTL
        await rejection(limiter.reserve(t, 0, request_id="other"))
    await limiter.reserve(t, 0, request_id="other")
