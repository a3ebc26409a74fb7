"""Choose a :class:`~limits.interfaces.CounterStore` by URL."""

from __future__ import annotations

from typing import Literal

from limits.clock import MonotonicClock
from limits.failover import FailoverStore
from limits.interfaces import Clock, CounterStore
from limits.memory_store import MemoryStore
from limits.redis_store import RedisStore

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(
    url: str,
    *,
    failure: Literal["open", "closed"] = "open",
    timeout_s: float = 0.25,
    clock: Clock | None = None,
    max_pending_releases: int = 10_000,
) -> CounterStore:
    """Open the store for ``url`` (``LimitsConfig.store_url``).

    Args:
        url: ``memory://`` → :class:`MemoryStore`; ``redis://``, ``rediss://`` or
            ``unix://`` → a :class:`RedisStore` wrapped in a :class:`FailoverStore`.
        failure: what a Redis outage does — ``"open"`` (default) falls back to a
            local limiter, ``"closed"`` rejects with 503 ``overloaded``.
        timeout_s: Redis connect and read timeout, s (``LimitsConfig.redis_timeout_s``).
        clock: time source of the in-process store (default: monotonic).
        max_pending_releases: bound of the releases kept for Redis while it is down
            (``LimitsConfig.max_pending_releases``; see :class:`FailoverStore`).

    Raises:
        ValueError: any other scheme.

    The store connects lazily; the caller closes it (``await store.close()``).
    """
    local = MemoryStore(clock or MonotonicClock())
    if url.startswith("memory://"):
        return local
    if url.startswith(_REDIS_SCHEMES):
        return FailoverStore(RedisStore.from_url(url, timeout_s=timeout_s), local,
                             failure=failure, max_pending_releases=max_pending_releases)
    raise ValueError(f"unsupported counter store URL {url!r}: use memory:// or redis://")
