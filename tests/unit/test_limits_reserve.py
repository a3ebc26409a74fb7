"""InteractiveReserve: the demand estimate, the reserve it yields, and who may take a
slot (limits.reserve)."""

from __future__ import annotations

import math

import pytest

from config.schema import SaturationConfig
from limits.reserve import InteractiveReserve

M = "m"


def busy(r: InteractiveReserve, interactive: int = 0, others: int = 0) -> InteractiveReserve:
    for _ in range(interactive):
        r.started(M, "interactive")
    for _ in range(others):
        r.started(M, "batch")
    return r


def test_no_interactive_demand_reserves_nothing() -> None:
    r = InteractiveReserve()
    assert r.observe(M, 0, 0.0) == 0
    assert r.reserved(M, 32) == 0
    assert r.admits(M, "batch", 32, 0, 0.0)
    busy(r, others=31)
    assert r.admits(M, "standard", 32, 0, 0.0)  # the last slot
    busy(r, others=1)
    assert not r.admits(M, "standard", 32, 0, 0.0)


def test_reserve_is_demand_plus_one_poisson_sd() -> None:
    r = busy(InteractiveReserve(headroom_sd=1.0), interactive=9)
    assert r.observe(M, 0, 0.0) == 9
    assert r.reserved(M, 32) == 12  # 9 + sqrt(9)
    assert r.reserved(M, 10) == 10  # never more than the slots
    r0 = busy(InteractiveReserve(headroom_sd=0.0), interactive=9)
    r0.observe(M, 0, 0.0)
    assert r0.reserved(M, 32) == 9


def test_others_take_only_slots_beyond_the_reserve() -> None:
    # 32 slots, 9 interactive in flight → reserve 12 → others may hold 20
    r = busy(InteractiveReserve(), interactive=9, others=19)
    assert r.admits(M, "standard", 32, 0, 0.0)
    r.started(M, "standard")
    assert not r.admits(M, "batch", 32, 0, 0.0)
    assert r.admits(M, "interactive", 32, 0, 0.0)  # interactive is never held back


def test_waiting_interactive_counts_as_demand_and_blocks_others() -> None:
    r = InteractiveReserve()
    assert not r.admits(M, "batch", 32, 1, 0.0)  # a ticket waits: nothing else goes
    assert r.observe(M, 4, 0.0) == 4
    assert r.admits(M, "batch", 32, 0, 0.0) is True  # reserve 4 + 2 = 6 of 32


def test_estimate_rises_at_once_and_decays_with_tau() -> None:
    r = busy(InteractiveReserve(tau_s=10.0), interactive=20)
    assert r.observe(M, 0, 0.0) == 20
    for _ in range(20):
        r.finished(M, "interactive")
    # demand is 0 now; the estimate decays from 20 with time constant 10 s
    assert r.observe(M, 0, 10.0) == pytest.approx(20 * math.exp(-1))
    assert r.observe(M, 0, 60.0) == pytest.approx(20 * math.exp(-6))
    busy(r, interactive=5)
    assert r.observe(M, 0, 60.0) == 5  # a burst is reserved for at once


def test_recent_burst_keeps_its_slots_from_batch() -> None:
    r = busy(InteractiveReserve(tau_s=10.0), interactive=28)
    r.observe(M, 0, 0.0)
    for _ in range(28):
        r.finished(M, "interactive")
    # 1 s after the burst ended the estimate is still ~25 → 30 slots kept
    assert not busy(r, others=3).admits(M, "batch", 32, 0, 1.0)
    # after ~5 tau it has decayed and batch may use the engines again
    assert r.admits(M, "batch", 32, 0, 50.0)


def test_in_flight_counts_follow_start_and_finish() -> None:
    r = busy(InteractiveReserve(), interactive=2, others=3)
    r.finished(M, "standard")
    r.finished(M, "interactive")
    assert r.in_flight(M) == {"interactive": 1, "others": 2}


def test_config_defaults() -> None:
    s = SaturationConfig()
    assert not s.adaptive_reserve and s.reserve_tau_s == 10.0 and s.reserve_headroom_sd == 1.0
    with pytest.raises(ValueError):
        SaturationConfig(reserve_tau_s=0)
