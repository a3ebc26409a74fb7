"""The gateway's queue of prefill legs (``gateway.prefill_queue``): which held leg
leaves first, and when legs are held, released and shed."""

from __future__ import annotations

import asyncio

import pytest

from engines.pool import Engine
from gateway.prefill_queue import HeldLeg, LegShed, PrefillQueue, pick
from tests.support import ManualClock, wait_for

C = 1e-4  # s per prefill token: 1,000 tokens take 0.1 s


def leg(tokens: int, start_by: float, seq: int) -> HeldLeg:
    return HeldLeg(tokens, start_by, sheddable=True, seq=seq, released=None)  # type: ignore[arg-type]


def test_pick_serves_the_shortest_leg_while_the_legs_it_overtakes_keep_their_start():
    long = leg(5000, start_by=0.6, seq=0)  # 0.5 s of prefill; must start by 0.6 s
    mid = leg(1000, start_by=5.0, seq=1)
    short = leg(200, start_by=5.0, seq=2)
    # 0.02 s of the short one first still lets the long one start by 0.6 s
    assert pick([long, mid, short], now=0.0, backlog_s=0.0, s_per_token=C) is short
    # with 0.55 s of prefill outstanding the long leg has 0.05 s of slack: the
    # short one (0.02 s) may go first, the 1,000-token one (0.1 s) may not
    assert pick([long, mid], now=0.0, backlog_s=0.55, s_per_token=C) is long
    assert pick([long, mid, short], now=0.0, backlog_s=0.55, s_per_token=C) is short
    # with 0.59 s outstanding nothing fits ahead of the long leg
    assert pick([long, mid, short], now=0.0, backlog_s=0.59, s_per_token=C) is long


def test_pick_does_not_protect_a_leg_already_too_late():
    late = leg(5000, start_by=0.1, seq=0)  # cannot start by 0.1 s behind 0.2 s of work
    short = leg(200, start_by=5.0, seq=1)
    assert pick([late, short], now=0.0, backlog_s=0.2, s_per_token=C) is short
    # a protected leg behind the late one is still protected
    tight = leg(3000, start_by=0.71, seq=2)  # starts at 0.2 + 0.5 = 0.7 s in EDF order
    # the short leg (0.02 s) would make it late; it may overtake the late one itself
    assert pick([late, tight, short], now=0.0, backlog_s=0.2, s_per_token=C) is tight
    tight.start_by = 0.75  # 0.05 s of slack: room for the short leg's 0.02 s
    assert pick([late, tight, short], now=0.0, backlog_s=0.2, s_per_token=C) is short
    # once past its latest start (not shed: at best effort) it is served in order
    assert pick([late, tight, short], now=0.15, backlog_s=0.2, s_per_token=C) is late


def test_pick_breaks_ties_by_arrival():
    a, b = leg(300, 9.0, seq=0), leg(300, 9.0, seq=1)
    assert pick([b, a], now=0.0, backlog_s=0.0, s_per_token=C) is a


def engine() -> Engine:
    return Engine(id="p", model="m", base_url="http://p", labels={"role": "prefill"})


class Fleet:
    """A prefill engine's outstanding tokens, as :class:`PrefillSpeed` keeps them."""

    def __init__(self, hold_tokens: int = 1000) -> None:
        self.clock = ManualClock(t=0.0)
        self.outstanding: dict[str, int] = {}
        self.queue = PrefillQueue(self.outstanding, lambda _e: C, self.clock,
                                  hold_tokens=hold_tokens)
        self.e = engine()
        self.sent: list[int] = []

    async def send(self, tokens: int, start_by: float = float("inf"),
                   sheddable: bool = True) -> None:
        """A leg's life up to its send: admitted, then counted outstanding."""
        counted = await self.queue.admit(self.e, tokens, start_by, sheddable)
        self.outstanding["p"] = self.outstanding.get("p", 0) + tokens
        counted()
        self.sent.append(tokens)

    def computed(self, tokens: int) -> None:
        """A sent leg reached its first token."""
        self.outstanding["p"] -= tokens
        self.queue.release(self.e)

    def held(self) -> list[int]:
        """The tokens of the legs held for the engine, in arrival order."""
        return [h.tokens for h in self.queue.held.get("p", [])]


async def test_legs_beyond_the_hold_wait_and_leave_shortest_first():
    f = Fleet(hold_tokens=1000)
    await f.send(900)  # under the hold: sent at once
    await f.send(400)  # 900 outstanding < 1000: sent at once
    assert f.sent == [900, 400]
    waiting = [asyncio.create_task(f.send(n)) for n in (2000, 700, 100)]
    await wait_for(lambda: f.held() == [2000, 700, 100])
    assert f.sent == [900, 400]
    # a new 300-token leg waits behind the outstanding 1,300 and the held 100
    assert f.queue.wait_s(f.e, 300) == pytest.approx((1300 + 100) * C)
    f.computed(900)  # 400 outstanding: the shortest legs go while under the hold
    await wait_for(lambda: len(f.sent) == 4)
    assert f.sent[2:] == [100, 700]  # 400 + 100 + 700 = 1,200: 2,000 stays
    f.computed(400)  # 800 outstanding
    await asyncio.gather(*waiting)
    assert f.sent[4:] == [2000] and f.queue.held["p"] == []
    assert f.queue.wait_s(f.e, 1) == pytest.approx(2800 * C)  # only what was sent


async def test_a_held_leg_past_its_latest_start_is_shed_when_sheddable():
    f = Fleet(hold_tokens=500)
    await f.send(600)
    doomed = asyncio.create_task(f.send(300, start_by=0.5))
    kept = asyncio.create_task(f.send(300, start_by=0.5, sheddable=False))
    await wait_for(lambda: f.held() == [300, 300])
    f.clock.advance(1.0)
    f.computed(600)
    with pytest.raises(LegShed) as shed:
        await doomed
    assert shed.value.args[0] == pytest.approx(0.5)  # 0.5 s past its latest start
    await kept  # not sheddable: served late
    assert f.sent == [600, 300]


@pytest.mark.parametrize("settled", [True, False],
                         ids=["release-after-its-waiter-ran", "release-before-its-waiter-ran"])
async def test_a_cancelled_leg_leaves_the_queue_and_frees_its_place(settled):
    f = Fleet(hold_tokens=500)
    await f.send(600)
    gone = asyncio.create_task(f.send(100))
    after = asyncio.create_task(f.send(200))
    await wait_for(lambda: f.held() == [100, 200])
    gone.cancel()
    if settled:  # its waiter took it out of the queue
        await wait_for(lambda: f.held() == [200])
    f.computed(600)  # else the release finds it cancelled and still queued
    await after
    assert f.sent == [600, 200] and gone.cancelled()
    assert f.queue.wait_s(f.e, 1) == pytest.approx(200 * C)


async def test_a_leg_cancelled_as_it_is_released_returns_its_place():
    f = Fleet(hold_tokens=500)
    await f.send(600)
    gone = asyncio.create_task(f.send(100))
    later = asyncio.create_task(f.send(450))
    await wait_for(lambda: f.held() == [100, 450])
    f.computed(600)  # releases 100 (shortest) and 450 (100 < 500) at once
    gone.cancel()  # before its waiter runs
    with pytest.raises(asyncio.CancelledError):
        await gone
    await later
    assert f.sent == [600, 450]
    assert f.queue.wait_s(f.e, 1) == pytest.approx(450 * C)  # no place left reserved


async def test_a_decode_engine_gets_a_prefill_only_when_it_fits_the_step_budget():
    """With a step budget (a decode engine), a prefill is sent only when it fits
    beside what is outstanding, or when nothing is; held ones leave shortest first
    as they come to fit."""
    f = Fleet()
    budget = {"p": 1000.0}
    f.queue.step_tokens = lambda e: budget[e.id]
    await f.send(1500)  # nothing outstanding: sent, however long
    waiting = [asyncio.create_task(f.send(n)) for n in (700, 300)]
    await wait_for(lambda: f.held() == [700, 300])
    f.computed(1500)  # nothing outstanding: the shortest goes, then 700 fits beside it
    await asyncio.gather(*waiting)
    assert f.sent == [1500, 300, 700]
    assert f.queue.wait_s(f.e, 1) == pytest.approx(1000 * C)
    later = asyncio.create_task(f.send(100))  # 1,000 + 100 > 1,000: held
    await wait_for(lambda: f.held() == [100])
    f.computed(300)  # 700 + 100 fits
    await later
    budget["p"] = 500.0  # the budget fell (a larger batch): 800 outstanding, 50 waits
    last = asyncio.create_task(f.send(50))
    await wait_for(lambda: f.held() == [50])
    f.computed(700)  # 100 + 50 fits 500
    await last
    assert f.sent == [1500, 300, 700, 100, 50]
