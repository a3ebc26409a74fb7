"""Rate of events (queue departures) as a continuously decaying average."""

from __future__ import annotations

import math


class DrainRate:
    """Exponentially weighted moving average of an event rate, events/s.

    Each event adds ``1 / tau_s`` to an estimate that decays by ``exp(−Δt / tau_s)``
    between readings — the exponential-kernel rate estimator behind the Unix load
    average (an EWMA in continuous time). A steady rate ``r`` reads ``r`` after a
    few ``tau_s``; a stall decays towards 0 with time constant ``tau_s``.

    Args:
        tau_s: time constant, s (default 10).
    """

    def __init__(self, tau_s: float = 10.0) -> None:
        self._tau_s = tau_s
        self._value = 0.0
        self._at = 0.0

    def add(self, now: float) -> None:
        """Record one event at ``now`` (s)."""
        self._value = self.rate(now) + 1.0 / self._tau_s
        self._at = now

    def rate(self, now: float) -> float:
        """Estimated events per second at ``now`` (s)."""
        return self._value * math.exp(-max(0.0, now - self._at) / self._tau_s)
