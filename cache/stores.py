"""Byte stores for cached responses.

* ``memory://`` — :class:`MemoryByteStore`: one process, LRU bounded by the total size
  of keys and values in bytes, lazy per-entry expiry.
* ``redis://`` / ``rediss://`` / ``unix://`` — :class:`RedisByteStore`: shared by
  every replica, ``SET … PX ttl`` per entry.

:func:`cache.service.open_cache` picks one by ``CacheConfig.store_url``.
"""

from __future__ import annotations

from collections import OrderedDict

import redis.asyncio as aioredis

from limits.clock import MONOTONIC
from limits.interfaces import Clock


class MemoryByteStore:
    """LRU byte store for one process.

    Args:
        max_bytes: cap on the sum of ``len(key) + len(value)``, bytes; the least
            recently used entries are dropped to stay under it; a single value larger
            than the cap is not stored.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, max_bytes: int, clock: Clock = MONOTONIC) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock.now():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        if key in self._entries:
            self._drop(key)
        size = len(key) + len(value)
        if size > self.max_bytes:
            return
        while self.used_bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (value, self._clock.now() + ttl_s)
        self.used_bytes += size

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self.used_bytes -= len(key) + len(value)

    async def close(self) -> None:
        self._entries.clear()
        self.used_bytes = 0


class RedisByteStore:
    """Redis-backed store; each entry expires after its own TTL (``SET PX``).

    Args:
        client: a ``redis.asyncio.Redis`` (bytes responses). :meth:`close` closes it.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self, key: str) -> bytes | None:
        return await self.client.get(key)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        await self.client.set(key, value, px=max(1, int(ttl_s * 1000)))

    async def close(self) -> None:
        await self.client.aclose()
