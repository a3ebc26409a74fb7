"""The real clock."""

from __future__ import annotations

import time


class MonotonicClock:
    """:class:`~limits.interfaces.Clock` over ``time.monotonic`` (the clock asyncio's
    event loop uses), seconds."""

    def now(self) -> float:
        return time.monotonic()
