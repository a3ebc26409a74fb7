"""Rate of events (queue departures) as a continuously decaying average."""

from __future__ import annotations

import math


class DrainRate:
    """Exponentially weighted moving average of an event rate, events/s.

    Each event adds ``1 / tau_s`` to an estimate that decays by ``exp(−Δt / tau_s)``
    between readings — the exponential-kernel rate estimator behind the Unix load
    average (an EWMA in continuous time). A steady rate ``r`` reads ``r`` after a
    few ``tau_s``; a stall decays towards 0 with time constant ``tau_s``.

    Started from zero, the sum only reaches a steady rate after a few ``tau_s``, so
    for the first events it is divided by ``1 − exp(−t / tau_s)``, ``t`` the time since
    the first event (at least ``min_span_s``) — the start-up bias correction of an
    exponential average (as in Adam, Kingma & Ba 2015) — instead of reading a busy
    start as a slow drain.

    Args:
        tau_s: time constant, s (default 10).
        min_span_s: shortest span the correction assumes, s (default 1).
    """

    def __init__(self, tau_s: float = 10.0, min_span_s: float = 1.0) -> None:
        self._tau_s = tau_s
        self._min_span_s = min_span_s
        self._value = 0.0
        self._at = 0.0
        self._first: float | None = None

    def add(self, now: float) -> None:
        """Record one event at ``now`` (s)."""
        if self._first is None:
            self._first = now
        self._value = self._decayed(now) + 1.0 / self._tau_s
        self._at = now

    def rate(self, now: float) -> float:
        """Estimated events per second at ``now`` (s)."""
        if self._first is None:
            return 0.0
        return self._decayed(now) / self._correction(now)

    def restart(self, rate: float, now: float) -> None:
        """Make the estimate read ``rate`` (events/s) at ``now`` (s) and decay from
        there: the average restarted at a detected change of the rate, instead of
        taking ``tau_s`` to reach the new level."""
        if self._first is None:
            self._first = now
        self._value = rate * self._correction(now)
        self._at = now

    def _correction(self, now: float) -> float:
        """The start-up divisor ``1 − exp(−t / tau_s)`` at ``now`` (class docstring)."""
        span = max(self._min_span_s, now - self._first)
        return -math.expm1(-span / self._tau_s)

    def _decayed(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._at) / self._tau_s)


class ServiceRate:
    """Departures per second from a *backlogged* queue: the reciprocal of an EWMA of
    the gaps between departures while tickets wait (the first gap of a backlog counts
    from the moment it formed). Unlike :class:`DrainRate` it does not read a lightly
    loaded queue's arrival rate as its capacity: a burst at low load queues behind
    engines that free up quickly, and this rate says so.

    Args:
        alpha: weight of each new gap (0–1, default 0.2).
        min_samples: gaps before :meth:`rate` answers (default 5).
    """

    def __init__(self, alpha: float = 0.2, min_samples: int = 5) -> None:
        self._alpha = alpha
        self._min_samples = min_samples
        self._mean_gap = 0.0
        self._samples = 0
        self._mark: float | None = None

    def backlogged(self, now: float) -> None:
        """Tickets are waiting at ``now`` (s); starts a gap unless one is running."""
        if self._mark is None:
            self._mark = now

    def departed(self, now: float, *, backlog_left: bool) -> None:
        """A waiting ticket was placed at ``now`` (s); ``backlog_left``: others still
        wait."""
        if self._mark is not None:
            gap = max(0.0, now - self._mark)
            self._mean_gap = gap if self._samples == 0 else (
                self._mean_gap + self._alpha * (gap - self._mean_gap))
            self._samples += 1
        self._mark = now if backlog_left else None

    def idle(self) -> None:
        """The queue emptied without a departure (timeouts, cancellations)."""
        self._mark = None

    def rate(self) -> float | None:
        """Departures per second while backlogged, or None before ``min_samples``."""
        if self._samples < self._min_samples:
            return None
        return 1.0 / self._mean_gap if self._mean_gap > 0 else float("inf")
