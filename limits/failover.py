"""Keep rate limiting answering while Redis is unreachable.

:class:`FailoverStore` wraps a :class:`~limits.redis_store.RedisStore` (primary) and
a local :class:`~limits.memory_store.MemoryStore` (fallback). The first failed call
marks Redis down (one warning, ``failovers`` + 1); from then on no request touches
Redis: ``failure="open"`` serves every call from the fallback (each replica then
enforces the limits on its own, so a cluster of N replicas admits up to N× a limit
until Redis returns), ``failure="closed"`` rejects takes and acquires with
``Rejected(Outcome.OVERLOADED, reason="store_unavailable")``. A background probe
pings Redis with exponential backoff (``backoff_s`` doubling up to ``max_backoff_s``)
and switches back on the first answer (one info log). State built up in the
fallback is not copied back; leases held there are still released there.

:meth:`adjust` and :meth:`release` never raise (they run in ``finally`` paths); in
either mode they go to the fallback while Redis is down, where they are harmless
for state the fallback never saw.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from limits.interfaces import Bucket, StoreUnavailable, TakeResult
from limits.memory_store import MemoryStore
from limits.outcome import Outcome, Rejected
from limits.redis_store import RedisStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class FailoverStore:
    """A :class:`~limits.interfaces.CounterStore` that survives Redis outages.

    Args:
        primary: the shared Redis store (its socket timeouts bound each attempt).
        fallback: the local store used while Redis is down (fail open).
        failure: ``"open"`` (default) or ``"closed"``.
        backoff_s: first wait before probing a down Redis, s (default 0.5).
        max_backoff_s: cap of the doubling probe wait, s (default 5).

    Attributes:
        failovers: how many times Redis went from up to down.
        healthy: whether calls currently go to Redis.
    """

    def __init__(
        self,
        primary: RedisStore,
        fallback: MemoryStore,
        *,
        failure: Literal["open", "closed"] = "open",
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.failure = failure
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.failovers = 0
        self.healthy = True
        self._probe: asyncio.Task[None] | None = None

    async def take(self, buckets: Sequence[Bucket]) -> TakeResult:
        ok, result = await self._try(lambda: self.primary.take(buckets))
        if ok:
            return result
        self._refuse_if_closed()
        return await self.fallback.take(buckets)

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        ok, granted = await self._try(lambda: self.primary.acquire(key, lease_id, limit, ttl_s))
        if ok:
            return granted
        self._refuse_if_closed()
        return await self.fallback.acquire(key, lease_id, limit, ttl_s)

    async def adjust(self, bucket: Bucket) -> None:
        ok, _ = await self._try(lambda: self.primary.adjust(bucket))
        if not ok:
            await self.fallback.adjust(bucket)

    async def release(self, key: str, lease_id: str) -> None:
        await self.fallback.release(key, lease_id)
        await self._try(lambda: self.primary.release(key, lease_id))

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self.primary.close()
        await self.fallback.close()

    async def _try(self, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """``(True, result)`` from Redis, or ``(False, None)`` when it is down."""
        if not self.healthy:
            return False, None
        try:
            return True, await call()
        except StoreUnavailable as e:
            self._mark_down(e)
            return False, None

    def _refuse_if_closed(self) -> None:
        if self.failure == "closed":
            raise Rejected(
                Outcome.OVERLOADED,
                "rate-limit store unavailable; try again shortly",
                retry_after_s=self.backoff_s,
                reason="store_unavailable",
            )

    def _mark_down(self, error: StoreUnavailable) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.failovers += 1
        log.warning(
            "Redis counter store unreachable (%s); failing %s until it returns",
            error, self.failure,
        )
        self._probe = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        wait = self.backoff_s
        while True:
            await asyncio.sleep(wait)
            try:
                await self.primary.ping()
            except StoreUnavailable:
                wait = min(wait * 2, self.max_backoff_s)
                continue
            self.healthy = True
            self._probe = None
            log.info("Redis counter store reachable again; limits are shared again")
            return
