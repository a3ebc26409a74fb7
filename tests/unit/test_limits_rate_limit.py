"""RateLimiter over the in-process store with a hand-driven clock."""

from __future__ import annotations

import asyncio

import pytest

from config.schema import TenantQuota
from limits.memory_store import MemoryStore
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter, Sizing, reservation_size
from tests.support import ManualClock, wait_for


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


async def test_request_larger_than_the_budget_is_never_admitted_nor_told_to_retry(
        limiter: RateLimiter) -> None:
    with pytest.raises(Rejected) as exc:
        await limiter.reserve(tenant(tokens_per_min=100), 101, request_id="x")
    e = exc.value
    assert e.outcome is Outcome.EXCEEDS_QUOTA and e.outcome.status == 400
    assert e.retry_after_s is None and not e.outcome.needs_retry_after
    assert e.reason == "tokens_per_min" and "never" in e.message
    assert limiter.open_reservations == 0


def size(t: TenantQuota, prompt: int, cap: int | None, sequences: int = 1) -> Sizing:
    return reservation_size(t, prompt_tokens=prompt, output_cap=cap, sequences=sequences,
                            default_output_tokens=256, output_param="max_completion_tokens",
                            prompt_param="messages")


def test_no_cap_reserves_the_default_lowered_to_what_the_budget_can_hold() -> None:
    assert size(tenant(), 50, None) == Sizing(50, 256)  # no tokens/min limit
    assert size(tenant(tokens_per_min=10_000), 50, None) == Sizing(50, 256)
    assert size(tenant(tokens_per_min=200), 50, None) == Sizing(50, 150)
    assert size(tenant(tokens_per_min=200), 50, None, sequences=4) == Sizing(50, 148)


def test_explicit_cap_times_sequences_is_reserved() -> None:
    assert size(tenant(tokens_per_min=1000), 20, 50, sequences=10) == Sizing(20, 500)
    assert size(tenant(), 20, 50, sequences=10).total == 520


@pytest.mark.parametrize("prompt,cap,sequences,param", [
    (20, 190, 1, "max_completion_tokens"),  # explicit cap too large
    (20, 50, 10, "max_completion_tokens"),  # n × cap too large
    (200, None, 1, "messages"),  # the prompt alone fills the budget
    (150, None, 60, "messages"),  # not even one output token per sequence fits
])
def test_a_request_that_can_never_fit_names_the_field_and_promises_no_retry(
        prompt: int, cap: int | None, sequences: int, param: str) -> None:
    with pytest.raises(Rejected) as exc:
        size(tenant(tokens_per_min=200), prompt, cap, sequences)
    e = exc.value
    assert e.outcome is Outcome.EXCEEDS_QUOTA and e.retry_after_s is None
    assert e.param == param and "200 tokens per minute" in e.message
    assert "max_tokens'" not in e.message


async def test_open_reservations_and_held_slots_return_to_zero(limiter: RateLimiter) -> None:
    t = tenant(tokens_per_min=1000, max_concurrent=2)
    async with await limiter.reserve(t, 100, request_id="a") as r:
        assert limiter.open_reservations == 1 and limiter.held_slots == 1
        await r.settle(80)
        assert limiter.open_reservations == 1  # settled, slot still held
    assert limiter.open_reservations == 0 and limiter.held_slots == 0
    async with await limiter.reserve(t, 0, request_id="hit", concurrency=False):
        assert limiter.open_reservations == 1 and limiter.held_slots == 0
    assert limiter.open_reservations == 0


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


class CountingStore(MemoryStore):
    """The in-process store, counting lease acquisitions (first takes and renewals)."""

    acquired = 0

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        self.acquired += 1
        return await super().acquire(key, lease_id, limit, ttl_s)


async def test_held_lease_is_renewed_past_its_ttl(clock: ManualClock) -> None:
    store = CountingStore(clock)
    limiter = RateLimiter(store, lease_ttl_s=0.2)  # renewed every 0.1 s of loop time
    t = tenant(max_concurrent=1)
    async with await limiter.reserve(t, 0, request_id="long-stream"):
        clock.advance(0.15)
        await wait_for(lambda: store.acquired >= 2, what="a lease renewal")
        clock.advance(0.15)  # past the first TTL (0.2 s), inside the renewed one
        await rejection(limiter.reserve(t, 0, request_id="other"))
    await limiter.reserve(t, 0, request_id="other")
