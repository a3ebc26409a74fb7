"""engines.breaker.CircuitBreaker with an injected clock, and Engine.routable."""

from __future__ import annotations

import pytest

from engines.breaker import BreakerState, CircuitBreaker
from engines.pool import Engine, EngineState
from tests.support import ManualClock as Clock


def test_opens_after_threshold_consecutive_failures_only():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, open_s=5.0, clock=clock)
    b.record(False)
    b.record(False)
    b.record(True)  # a success resets the streak
    b.record(False)
    b.record(False)
    assert (b.state, b.failures, b.admits(0)) == (BreakerState.CLOSED, 2, True)
    b.record(False)
    assert (b.state, b.failures, b.admits(0)) == (BreakerState.OPEN, 3, False)


def test_half_open_after_open_s_admits_one_probe_request():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=5.0, clock=clock)
    b.record(False)
    clock.t += 4.99
    assert b.state is BreakerState.OPEN and not b.admits(0)
    clock.t += 0.01
    assert b.state is BreakerState.HALF_OPEN
    assert b.admits(0) and not b.admits(1)  # one probe request at a time


def test_half_open_success_closes_failure_reopens_for_open_s():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, open_s=5.0, clock=clock)
    b.record(False)
    b.record(False)
    clock.t += 5
    b.record(False)  # the probe failed: open again from now
    assert b.state is BreakerState.OPEN
    clock.t += 4
    assert b.state is BreakerState.OPEN
    clock.t += 1
    assert b.state is BreakerState.HALF_OPEN
    b.record(True)
    assert (b.state, b.failures, b.admits(7)) == (BreakerState.CLOSED, 0, True)


def test_failures_while_open_do_not_extend_it():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=5.0, clock=clock)
    b.record(False)
    clock.t += 3
    b.record(False)  # a request dispatched before it opened failed late
    clock.t += 2
    assert b.state is BreakerState.HALF_OPEN


def test_invalid_settings_raise():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(open_s=0)


def test_engine_routable_needs_ready_state_and_breaker():
    clock = Clock()
    e = Engine(id="a", model="m", base_url="http://x",
               breaker=CircuitBreaker(failure_threshold=1, open_s=1.0, clock=clock))
    assert not e.routable  # starting
    e.state = EngineState.READY
    assert e.routable
    e.breaker.record(False)
    assert not e.routable
    clock.t += 1
    assert e.routable  # half-open, nothing in flight
    e.in_flight = 1
    assert not e.routable
