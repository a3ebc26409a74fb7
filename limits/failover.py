"""Keep rate limiting answering while Redis is unreachable.

:class:`FailoverStore` wraps a :class:`~limits.redis_store.RedisStore` (primary) and
a local :class:`~limits.memory_store.MemoryStore` (fallback). The first failed call
marks Redis down (one warning, ``failovers`` + 1); from then on no request touches
Redis: ``failure="open"`` serves every call from the fallback (each replica then
enforces the limits on its own, so a cluster of N replicas admits up to N× a limit
until Redis returns), ``failure="closed"`` rejects takes and acquires with
``Rejected(Outcome.OVERLOADED, reason="store_unavailable")``. Down means
unreachable, timing out, or answering but refusing work (a read-only replica, ``OOM``
under ``noeviction``, ``MISCONF``…: :func:`limits.redis_store.refuses_work`). A
background probe writes to Redis (:meth:`RedisStore.ping`) with exponential backoff
(``backoff_s`` doubling up to ``max_backoff_s``) and switches back on the first
accepted write (one info log). State built up in the fallback is not copied back;
leases held there are still released there.

Releases of leases granted *by Redis* that could not reach it (Redis down, or the
release itself failed), and of acquires that failed (a paused Redis runs a command
that timed out when it resumes), wait in a pending-release journal, bounded by
``max_pending_releases`` (``LimitsConfig.max_pending_releases``; past it the oldest
entry is dropped, with one warning per outage, and that lease frees only when its
``lease_ttl_s`` expires). On recovery the journal is replayed (one pipelined
``ZREM`` round trip) before calls go to Redis again, so a tenant is not told it has
requests in flight that ended during the outage.

:meth:`adjust` and :meth:`release` never raise (they run in ``finally`` paths); in
either mode they go to the fallback while Redis is down, where they are harmless
for state the fallback never saw.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
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
        max_pending_releases: bound of the pending-release journal, leases
            (default 10 000).

    Attributes:
        failovers: how many times Redis went from up to down.
        healthy: whether calls currently go to Redis.
        dropped_releases: journal entries dropped at the bound (their leases free
            when they expire in Redis).
    """

    def __init__(
        self,
        primary: RedisStore,
        fallback: MemoryStore,
        *,
        failure: Literal["open", "closed"] = "open",
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        max_pending_releases: int = 10_000,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.failure = failure
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_pending_releases = max_pending_releases
        self.failovers = 0
        self.dropped_releases = 0
        self.healthy = True
        self._probe: asyncio.Task[None] | None = None
        #: leases Redis granted and that are not released there yet (key, lease id);
        #: bounded by the requests in flight in this process
        self._in_redis: set[tuple[str, str]] = set()
        #: releases of such leases that have not reached Redis, oldest first
        self._pending: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._warned_drop = False

    @property
    def pending_releases(self) -> int:
        """Releases waiting for Redis to return."""
        return len(self._pending)

    async def take(self, buckets: Sequence[Bucket]) -> TakeResult:
        ok, result = await self._try(lambda: self.primary.take(buckets))
        if ok:
            return result
        self._refuse_if_closed()
        return await self.fallback.take(buckets)

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        tried = self.healthy
        ok, granted = await self._try(lambda: self.primary.acquire(key, lease_id, limit, ttl_s))
        if ok:
            if granted:
                self._in_redis.add((key, lease_id))
            return granted
        if tried:  # if it timed out, a paused Redis still runs it when it resumes
            self._journal((key, lease_id))
        self._refuse_if_closed()
        return await self.fallback.acquire(key, lease_id, limit, ttl_s)

    async def adjust(self, bucket: Bucket) -> None:
        ok, _ = await self._try(lambda: self.primary.adjust(bucket))
        if not ok:
            await self.fallback.adjust(bucket)

    async def release(self, key: str, lease_id: str) -> None:
        await self.fallback.release(key, lease_id)
        lease = (key, lease_id)
        ok, _ = await self._try(lambda: self.primary.release(key, lease_id))
        if ok:
            self._in_redis.discard(lease)
        elif lease in self._in_redis:  # Redis still counts it: release it there later
            self._in_redis.discard(lease)
            self._journal(lease)

    def _journal(self, lease: tuple[str, str]) -> None:
        self._pending[lease] = None
        while len(self._pending) > self.max_pending_releases:
            self._pending.popitem(last=False)
            self.dropped_releases += 1
            if not self._warned_drop:
                self._warned_drop = True
                log.warning("more than %d releases wait for Redis; dropping the oldest "
                            "(those slots free when their leases expire)",
                            self.max_pending_releases)

    async def _replay(self) -> None:
        """Send the journal to Redis; entries stay journaled if it fails.

        Raises:
            StoreUnavailable: Redis refused or did not answer."""
        while self._pending:
            batch = list(itertools.islice(self._pending, 1000))
            await self.primary.release_many(batch)
            for lease in batch:
                self._pending.pop(lease, None)

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
                replayed = len(self._pending)
                await self._replay()
            except StoreUnavailable:
                wait = min(wait * 2, self.max_backoff_s)
                continue
            self.healthy = True
            self._probe = None
            self._warned_drop = False
            log.info("Redis counter store reachable again; limits are shared again "
                     "(%d pending releases replayed)", replayed)
            return
