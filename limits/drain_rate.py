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
        span = max(self._min_span_s, now - self._first)
        return self._decayed(now) / -math.expm1(-span / self._tau_s)

    def _decayed(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._at) / self._tau_s)
