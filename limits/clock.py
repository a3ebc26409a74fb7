"""The real clock: the one :class:`~limits.interfaces.Clock` the gateway, the limits,
the engines' supervisor and the response cache read (tests inject their own)."""

from __future__ import annotations

import time


class MonotonicClock:
    """:class:`~limits.interfaces.Clock` over ``time.monotonic`` (the clock asyncio's
    event loop uses), seconds."""

    def now(self) -> float:
        return time.monotonic()


#: The process's real clock, shared as the default of every ``clock`` argument.
MONOTONIC = MonotonicClock()
