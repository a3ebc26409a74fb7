"""AdmissionQueue with a fake ``place`` that admits a set number of tickets, on a
hand-driven clock."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from config.schema import QueueConfig, TenantQuota
from limits.admission import AdmissionQueue, Ticket
from limits.outcome import Outcome, Rejected
from tests.support import ManualClock, wait_for


class Capacity:
    """``place`` succeeds while ``slots`` > 0; ``undo`` gives the slot back."""

    def __init__(self, slots: int = 0) -> None:
        self.slots = slots
        self.placed: list[Ticket] = []
        self.undone: list[Ticket] = []

    def place(self, ticket: Ticket) -> Ticket | None:
        if self.slots <= 0:
            return None
        self.slots -= 1
        self.placed.append(ticket)
        return ticket

    def undo(self, ticket: Ticket) -> None:
        self.slots += 1
        self.undone.append(ticket)


def make_queue(clock: ManualClock | None = None, **cfg: int) -> AdmissionQueue[Ticket]:
    # a long retry interval: only kick() places, so tests decide when capacity appears
    return AdmissionQueue("m", QueueConfig(**cfg), clock or ManualClock(), retry_interval_s=30)


def quota(name: str = "t", **kw: object) -> TenantQuota:
    return TenantQuota(name=name, **kw)  # type: ignore[arg-type]


def start(q: AdmissionQueue[Ticket], cap: Capacity, ticket: Ticket) -> asyncio.Task[Ticket]:
    return asyncio.ensure_future(q.admit(ticket, cap.place, cap.undo))


async def test_fast_path_places_without_suspending() -> None:
    q, cap = make_queue(), Capacity(1)
    t = q.ticket(quota(), 100)
    coro = q.admit(t, cap.place, cap.undo)
    with pytest.raises(StopIteration) as done:
        coro.send(None)  # completes on the first step: no await, no task switch
    assert done.value.value is t and t.queue_wait_s == 0


async def test_priority_bands_in_order() -> None:
    q, cap = make_queue(ManualClock(step=0.001)), Capacity(0)  # each read moves it 1 ms
    order = ["batch", "standard", "interactive", "batch", "interactive"]
    tasks = [start(q, cap, q.ticket(quota(f"t{i}", priority=p), 10, request_id=f"{p}{i}"))
             for i, p in enumerate(order)]
    await wait_for(lambda: len(q) == 5)
    assert q.depth() == {"interactive": 2, "standard": 1, "batch": 2}
    assert q.tokens_queued == 50
    for i in range(len(order)):
        cap.slots = 1
        q.kick()
        await wait_for(lambda i=i: len(cap.placed) == i + 1)
    assert [t.priority for t in cap.placed] == [
        "interactive", "interactive", "standard", "batch", "batch"]
    assert [t.request_id for t in cap.placed[:2]] == ["interactive2", "interactive4"]
    await asyncio.gather(*tasks)
    assert all(t.queue_wait_s > 0 for t in cap.placed)
    assert len(q) == 0 and q.tokens_queued == 0


async def test_weighted_fair_share_on_tokens() -> None:
    q, cap = make_queue(max_requests=1200, max_tokens=10**8), Capacity(0)
    rng = random.Random(7)
    heavy, light = quota("heavy", weight=3.0), quota("light", weight=1.0)
    tasks = [start(q, cap, q.ticket(t, rng.randint(50, 3000)))
             for _ in range(400) for t in (heavy, heavy, light)]
    await wait_for(lambda: len(q) == 1200)
    served = {"heavy": 0, "light": 0}
    while sum(1 for t in cap.placed if t.tenant == "light") < 200:  # both stay backlogged
        cap.slots = 4  # the engines take 4 requests per kick
        q.kick()
        await wait_for(lambda: cap.slots == 0)
    for t in cap.placed:
        served[t.tenant] += t.tokens
    ratio = served["heavy"] / served["light"]
    assert 2.7 <= ratio <= 3.3, ratio
    q.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_deadline_expiry_is_a_queue_timeout() -> None:
    q, cap = make_queue(), Capacity(0)
    t = q.ticket(quota(max_queue_wait_s=10), 10, timeout_s=0.05)  # client header wins
    with pytest.raises(Rejected) as exc:
        await q.admit(t, cap.place, cap.undo)
    assert exc.value.outcome is Outcome.QUEUE_TIMEOUT and exc.value.reason == "queue_timeout"
    assert isinstance(exc.value.retry_after_s, int) and exc.value.retry_after_s >= 1
    assert len(q) == 0 and q.tokens_queued == 0


async def test_deadline_sources() -> None:
    clock = ManualClock()
    q = make_queue(clock, default_max_wait_s=7)
    now = clock.t
    assert q.ticket(quota(), 1).deadline == now + 7
    assert q.ticket(quota(max_queue_wait_s=3), 1).deadline == now + 3
    assert q.ticket(quota(max_queue_wait_s=3), 1, timeout_s=60).deadline == now + 3
    assert q.ticket(quota(), 1, timeout_s=1).deadline == now + 1


async def test_full_queue_sheds_lowest_priority_newest() -> None:
    q, cap = make_queue(max_requests=3), Capacity(0)
    b1 = start(q, cap, q.ticket(quota("a", priority="batch"), 10))
    b2 = start(q, cap, q.ticket(quota("b", priority="batch"), 10))
    s1 = start(q, cap, q.ticket(quota("c", priority="standard"), 10))
    await wait_for(lambda: len(q) == 3)
    i1 = start(q, cap, q.ticket(quota("d", priority="interactive"), 10))
    await wait_for(b2.done)
    assert b2.done() and not b1.done()  # the newest batch ticket made room
    shed = b2.exception()
    assert isinstance(shed, Rejected) and shed.outcome is Outcome.OVERLOADED
    assert shed.reason == "queue_full" and shed.retry_after_s >= 1
    with pytest.raises(Rejected) as exc:  # incoming batch is itself the newest lowest
        await q.admit(q.ticket(quota("e", priority="batch"), 10), cap.place, cap.undo)
    assert exc.value.reason == "queue_full"
    assert q.depth() == {"interactive": 1, "standard": 1, "batch": 1}
    q.close()
    await asyncio.gather(b1, s1, i1, return_exceptions=True)


async def test_token_bound_sheds_too() -> None:
    q, cap = make_queue(max_tokens=1000), Capacity(0)
    batch = start(q, cap, q.ticket(quota("a", priority="batch"), 600))
    await wait_for(lambda: len(q) == 1)
    urgent = start(q, cap, q.ticket(quota("b", priority="interactive"), 600))
    await wait_for(batch.done)
    assert isinstance(batch.exception(), Rejected) and q.tokens_queued == 600
    with pytest.raises(Rejected):  # bigger than the whole queue
        await q.admit(q.ticket(quota("c", priority="interactive"), 1001), cap.place, cap.undo)
    q.close()
    await asyncio.gather(urgent, return_exceptions=True)


async def test_cancelled_waiter_leaves_at_once() -> None:
    q, cap = make_queue(), Capacity(0)
    task = start(q, cap, q.ticket(quota(), 10))
    await wait_for(lambda: len(q) == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(q) == 0 and q.tokens_queued == 0
    cap.slots = 1
    q.kick()
    nxt = q.ticket(quota("next"), 10)  # the slot goes to the next ticket, at once
    assert await q.admit(nxt, cap.place, cap.undo) is nxt and cap.placed == [nxt]


async def test_placement_for_a_waiter_cancelled_meanwhile_is_undone() -> None:
    q, cap = make_queue(), Capacity(0)
    task = start(q, cap, q.ticket(quota(), 10))
    await wait_for(lambda: len(q) == 1)
    cap.slots = 1
    q.kick()
    await asyncio.sleep(0)  # one loop step: the kick placed it; the waiter has not resumed yet
    assert len(cap.placed) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert cap.undone == cap.placed and cap.slots == 1


async def test_a_failing_place_fails_only_its_ticket() -> None:
    q, cap = make_queue(), Capacity(0)

    def broken(t: Ticket) -> Ticket | None:
        raise RuntimeError("boom")

    blocker = start(q, cap, q.ticket(quota("a"), 10))
    await wait_for(lambda: len(q) == 1)
    bad = asyncio.ensure_future(q.admit(q.ticket(quota("b"), 10), broken, cap.undo))
    good = start(q, cap, q.ticket(quota("c"), 10))
    await wait_for(lambda: len(q) == 3)
    cap.slots = 2
    q.kick()
    await wait_for(lambda: bad.done() and good.done())
    assert isinstance(bad.exception(), RuntimeError)
    assert {(await blocker).tenant, (await good).tenant} == {"a", "c"}


async def test_timer_retries_without_kicks() -> None:
    q = AdmissionQueue("m", QueueConfig(), ManualClock(), retry_interval_s=0.02)
    cap = Capacity(0)
    task = start(q, cap, q.ticket(quota(), 10))
    await wait_for(lambda: len(q) == 1)
    cap.slots = 1  # capacity appears without anyone calling kick()
    assert (await asyncio.wait_for(task, 1)).tenant == "t"


async def test_retry_after_follows_the_drain_rate() -> None:
    q, cap = make_queue(), Capacity(10_000)
    assert q.retry_after_s() == 30  # nothing drained yet: the default wait
    for _ in range(200):  # 200 admissions at once: a fast drain
        await q.admit(q.ticket(quota(), 1), cap.place, cap.undo)
    assert q.retry_after_s() == 1
    assert isinstance(q.retry_after_s(), int)


async def test_predicted_wait_counts_only_bands_ahead() -> None:
    q, cap = make_queue(default_max_wait_s=7), Capacity(0)
    assert q.predicted_wait_s() == 7  # nothing drained yet
    tasks = [start(q, cap, q.ticket(quota("b", priority="batch"), 10)) for _ in range(9)]
    tasks.append(start(q, cap, q.ticket(quota("s"), 10)))
    await wait_for(lambda: len(q) == 10)
    cap.slots = 1
    q.kick()
    await wait_for(lambda: len(cap.placed) == 1)
    assert cap.placed[0].tenant == "s"  # the standard ticket went first: one admission drained
    # the clock stands still, so every reading sees the same drain rate (on a real clock
    # the rate decays between two readings and the ratios drift under load)
    whole = q.predicted_wait_s()  # 9 batch + 1 new over the drain rate
    assert q.predicted_wait_s("standard") == pytest.approx(whole / 10, rel=1e-12)
    assert q.predicted_wait_s("batch") == pytest.approx(whole, rel=1e-12)
    assert q.retry_after_s() == math.ceil(whole)
    q.close()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_drain_rate_reads_a_busy_start_as_busy() -> None:
    from limits.drain_rate import DrainRate

    d = DrainRate(tau_s=10)
    assert d.rate(0.0) == 0.0
    for i in range(30):  # 30 admissions in the first second
        d.add(i / 30)
    assert 25 < d.rate(1.0) < 35  # not 30 / tau = 3 per second
    assert d.rate(100.0) < 0.01  # and a stall still decays to 0


async def test_earliest_deadline_first_within_a_tenant() -> None:
    q, cap = make_queue(), Capacity(0)
    t_long = q.ticket(quota(), 10, timeout_s=20)
    t_short = q.ticket(quota(), 10, timeout_s=5)
    t_mid = q.ticket(quota(), 10, timeout_s=10)
    tasks = [start(q, cap, t) for t in (t_long, t_short, t_mid)]
    await wait_for(lambda: len(q) == 3)
    cap.slots = 3
    q.kick()
    await asyncio.gather(*tasks)
    assert cap.placed == [t_short, t_mid, t_long]


async def test_a_ticket_predicted_to_miss_is_shed_at_once_with_retry_after_from_drain() -> None:
    clock = ManualClock()
    q, cap = make_queue(clock), Capacity(0)
    tasks = [start(q, cap, q.ticket(quota(), 10, timeout_s=100)) for _ in range(9)]
    await wait_for(lambda: len(q) == 9)
    for i in range(6):  # the backlog drains one ticket per second
        clock.advance(1.0)
        cap.slots = 1
        q.kick()
        await wait_for(lambda i=i: len(cap.placed) == i + 1)
    assert len(q) == 3
    assert q.predicted_wait_s("standard") == pytest.approx(4.0)  # (3 ahead + itself) / 1 s
    # 4 tickets to drain at 1/s: 4 s ± 2 s; 2.5 s left is within one deviation (waits),
    # 1.5 s is not (shed)
    assert not q.surely_late("standard", 2.5) and q.surely_late("standard", 1.5)
    with pytest.raises(Rejected) as shed:
        await q.admit(q.ticket(quota(), 10, timeout_s=1.5), cap.place, cap.undo)
    assert shed.value.outcome is Outcome.OVERLOADED and shed.value.reason == "predicted_miss"
    assert shed.value.retry_after_s == 4  # the predicted drain of the backlog, not a constant
    assert len(q) == 3  # it never joined the queue
    fits = start(q, cap, q.ticket(quota(), 10, timeout_s=2.5))  # 4 s - 2 s < 2.5 s: waits
    await wait_for(lambda: len(q) == 4)
    assert not fits.done()
    q.close()
    await asyncio.gather(*tasks, fits, return_exceptions=True)


async def test_a_burst_at_low_load_is_not_shed_on_the_arrival_rate() -> None:
    clock = ManualClock()
    q, cap = make_queue(clock), Capacity(1)
    for _ in range(10):  # one request every 10 s: the admission rate is 0.1/s
        await q.admit(q.ticket(quota(), 10), cap.place, cap.undo)
        cap.slots = 1
        clock.advance(10)
    cap.slots = 0
    # a burst of 3 with 2 s deadlines: the admission rate would predict 30 s and shed
    # them, but no backlog has been seen, so nothing is predicted from it
    tasks = [start(q, cap, q.ticket(quota(), 10, timeout_s=2)) for _ in range(3)]
    await wait_for(lambda: len(q) == 3)
    assert not any(t.done() for t in tasks)
    cap.slots = 3
    q.kick()
    assert len(await asyncio.gather(*tasks)) == 3
