"""Exact response cache: complete OpenAI response bodies under :class:`CacheKey.exact`.

Values are the non-streaming response JSON as it was produced for the client
(UTF-8 JSON bytes in the :class:`~cache.interfaces.ByteStore`), under the store key
``sluice:cache:x:<exact hex>``. Keys stay inside this package.
"""

from __future__ import annotations

import json
from typing import Any

from cache.interfaces import ByteStore

KEY_PREFIX = "sluice:cache:x:"


class ExactCache:
    """Response bodies by exact key.

    Args:
        store: where the bytes live (memory or Redis).
        default_ttl_s: TTL when :meth:`put` gets none, s (``CacheConfig.default_ttl_s``).
    """

    def __init__(self, store: ByteStore, default_ttl_s: float) -> None:
        self.store = store
        self.default_ttl_s = default_ttl_s

    async def get(self, exact: str) -> dict[str, Any] | None:
        """The stored response for ``exact``, or None."""
        raw = await self.store.get(KEY_PREFIX + exact)
        return None if raw is None else json.loads(raw)

    async def put(self, exact: str, response: dict[str, Any], ttl_s: float | None = None) -> None:
        """Store ``response`` for ``ttl_s`` seconds (default: ``default_ttl_s``)."""
        raw = json.dumps(response, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        await self.store.set(KEY_PREFIX + exact, raw, ttl_s or self.default_ttl_s)
