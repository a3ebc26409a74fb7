"""Every CounterStore behaviour, against ``memory://`` (on a hand-driven clock) and a
real Redis (on its server clock: time passes for real)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from limits.interfaces import Bucket, CounterStore
from limits.stores import open_store
from tests.support import ManualClock

Elapse = Callable[[float], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[tuple[CounterStore, Elapse]]:
    """The store and how to let ``s`` seconds pass on its clock."""
    if request.param == "memory":
        clock = ManualClock()
        s = open_store("memory://", clock=clock)

        async def elapse(seconds: float) -> None:
            clock.advance(seconds)
    else:
        s = open_store(request.getfixturevalue("redis_url"))

        async def elapse(seconds: float) -> None:
            await asyncio.sleep(seconds)  # Redis's server clock: only real time moves it
    yield s, elapse
    await s.close()


@pytest.fixture
def store(backend: tuple[CounterStore, Elapse]) -> CounterStore:
    return backend[0]


@pytest.fixture
def elapse(backend: tuple[CounterStore, Elapse]) -> Elapse:
    return backend[1]


def per_min(key: str, limit: float, cost: float = 1) -> Bucket:
    return Bucket(key, cost, limit / 60, limit)


async def test_full_bucket_admits_exactly_burst(store: CounterStore) -> None:
    results = [await store.take([per_min("k", 10)]) for _ in range(13)]
    assert [r.allowed for r in results] == [True] * 10 + [False] * 3
    # one unit comes back every 60/10 = 6 s
    assert results[10].retry_after_s == pytest.approx(6, abs=0.1)
    assert results[10].denied == 0


async def test_cost_is_charged_in_units(store: CounterStore) -> None:
    assert (await store.take([per_min("t", 1000, cost=600)])).allowed
    assert (await store.take([per_min("t", 1000, cost=400)])).allowed
    denied = await store.take([per_min("t", 1000, cost=60)])
    assert not denied.allowed
    assert denied.retry_after_s == pytest.approx(3.6, abs=0.1)  # 60 tokens at 1000/min


async def test_cost_above_burst_never_fits(store: CounterStore) -> None:
    r = await store.take([per_min("t", 100, cost=101)])
    assert not r.allowed and r.retry_after_s > 0


async def test_multi_bucket_take_is_all_or_nothing(store: CounterStore) -> None:
    assert (await store.take([per_min("b", 5, cost=5)])).allowed
    r = await store.take([per_min("a", 5), per_min("b", 5)])
    assert not r.allowed and r.denied == 1
    # "a" was not charged by the denied take: its whole burst is still there
    assert (await store.take([per_min("a", 5, cost=5)])).allowed


async def test_denied_index_is_the_longest_wait(store: CounterStore) -> None:
    await store.take([per_min("x", 60, cost=60), per_min("y", 6, cost=6)])
    r = await store.take([per_min("x", 60), per_min("y", 6)])
    assert r.denied == 1 and r.retry_after_s == pytest.approx(10, abs=0.1)


async def test_bucket_refills_at_rate(store: CounterStore, elapse: Elapse) -> None:
    fast = Bucket("f", 1, 50, 1)  # 50/s, burst 1
    assert (await store.take([fast])).allowed
    denied = await store.take([fast])
    assert not denied.allowed and 0 < denied.retry_after_s <= 0.021
    await elapse(denied.retry_after_s + 0.01)
    assert (await store.take([fast])).allowed


async def test_refund_gives_units_back_but_never_beyond_full(store: CounterStore) -> None:
    for _ in range(3):
        assert (await store.take([per_min("r", 3)])).allowed
    assert not (await store.take([per_min("r", 3)])).allowed
    await store.adjust(per_min("r", 3, cost=-2))
    assert [(await store.take([per_min("r", 3)])).allowed for _ in range(3)] == [
        True, True, False]
    await store.adjust(per_min("fresh", 3, cost=-100))
    assert [(await store.take([per_min("fresh", 3)])).allowed for _ in range(4)] == [
        True, True, True, False]


async def test_extra_charge_can_go_into_debt(store: CounterStore) -> None:
    await store.adjust(per_min("d", 60, cost=90))  # 30 units of debt: 30 s + 1 s
    r = await store.take([per_min("d", 60)])
    assert not r.allowed and r.retry_after_s == pytest.approx(31, abs=0.1)


async def test_zero_cost_always_fits(store: CounterStore) -> None:
    await store.take([per_min("z", 2, cost=2)])
    assert (await store.take([per_min("z", 2, cost=0)])).allowed


async def test_keys_are_independent(store: CounterStore) -> None:
    assert (await store.take([per_min("k1", 1)])).allowed
    assert (await store.take([per_min("k2", 1)])).allowed


async def test_leases_limit_renew_and_release(store: CounterStore) -> None:
    assert await store.acquire("c", "a", 2, 60)
    assert await store.acquire("c", "b", 2, 60)
    assert not await store.acquire("c", "c", 2, 60)
    assert await store.acquire("c", "a", 2, 60)  # renewing a held lease succeeds
    await store.release("c", "a")
    await store.release("c", "a")  # idempotent
    await store.release("c", "never-held")
    assert await store.acquire("c", "c", 2, 60)
    assert not await store.acquire("c", "d", 2, 60)


async def test_expired_leases_free_their_slots(store: CounterStore, elapse: Elapse) -> None:
    assert await store.acquire("e", "crashed-replica", 1, 0.15)
    assert not await store.acquire("e", "other", 1, 60)
    await elapse(0.25)
    assert await store.acquire("e", "other", 1, 60)


async def test_renewal_extends_a_lease(store: CounterStore, elapse: Elapse) -> None:
    assert await store.acquire("n", "long", 1, 0.3)
    await elapse(0.2)
    assert await store.acquire("n", "long", 1, 0.3)
    await elapse(0.2)  # past the first expiry, inside the renewed one
    assert not await store.acquire("n", "other", 1, 60)


async def test_concurrent_takes_admit_exactly_the_burst(store: CounterStore) -> None:
    results = await asyncio.gather(*(store.take([per_min("race", 20)]) for _ in range(64)))
    assert sum(r.allowed for r in results) == 20
