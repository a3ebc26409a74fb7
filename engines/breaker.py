"""A per-engine circuit breaker: stop sending traffic to an engine whose requests
keep failing, and let a single request test it before it takes traffic again.

States (the pattern of Nygard, *Release It!*, 2007, ch. 5 "Circuit Breaker"):

* ``closed`` — requests flow; consecutive failures are counted, any success resets
  the count. ``failure_threshold`` failures in a row → ``open``.
* ``open`` — the engine takes no requests for ``open_s`` seconds.
* ``half-open`` — after ``open_s``: one request (the probe) may go; a success closes
  the breaker, a failure opens it again for another ``open_s``.

Writers: the gateway records each request that reached (or failed to reach) an
engine — a timeout before the first token or a refused connection is a failure, an
answer a success; the supervisor's runner records its 1-token inference probes.
Readers: :attr:`engines.pool.Engine.routable` (placement skips an engine whose
breaker does not :meth:`~CircuitBreaker.admits` it) and the runner (an engine whose
breaker is not closed gets an inference probe at its next probe).
"""

from __future__ import annotations

import enum

from limits.clock import MONOTONIC
from limits.interfaces import Clock


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """Closed / open / half-open breaker of one engine.

    Args:
        failure_threshold: consecutive failures that open it (≥ 1; the supervisor's
            ``failure_threshold``).
        open_s: how long it stays open before half-open, s (> 0).
        clock: monotonic clock, s.

    Raises:
        ValueError: ``failure_threshold`` < 1 or ``open_s`` ≤ 0.
    """

    def __init__(self, failure_threshold: int = 3, open_s: float = 7.0,
                 clock: Clock = MONOTONIC) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and open_s > 0")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock
        self._failures = 0
        self._opened_at: float | None = None

    @property
    def failures(self) -> int:
        """Consecutive failures recorded since the last success."""
        return self._failures

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock.now() - self._opened_at < self.open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def admits(self, in_flight: int) -> bool:
        """Whether a new request may go to the engine, given ``in_flight`` requests
        this gateway already has on it: always when closed, never when open, and
        when half-open only if nothing is in flight (the one probe request; once it
        is dispatched the count is 1 and the next request waits for its outcome)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and in_flight <= 0

    def record(self, ok: bool) -> None:
        """Note the outcome of one request or inference probe: a success closes the
        breaker and resets the count; a failure counts, and opens the breaker at
        ``failure_threshold`` in a row or at once when half-open (the probe failed)."""
        if ok:
            self._failures = 0
            self._opened_at = None
            return
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or (
                self._opened_at is None and self._failures >= self.failure_threshold):
            self._opened_at = self.clock.now()
