"""Interfaces of the cache package; implementations are chosen in :mod:`cache.stores`
(by URL) and :mod:`cache.embedder`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class ByteStore(Protocol):
    """Opaque bytes under string keys, with a time to live.

    ``memory://`` bounds itself by bytes (LRU); ``redis://`` by TTL and Redis'
    own ``maxmemory`` policy.
    """

    async def get(self, key: str) -> bytes | None:
        """The value, or None if absent or expired."""

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store ``value``; it expires ``ttl_s`` seconds from now."""

    async def close(self) -> None:
        """Release connections; idempotent."""


class Embedder(Protocol):
    """A sentence encoder. ``encode`` blocks (CPU-bound): call it from a worker thread,
    as :class:`cache.embedder.BatchingEmbedder` does.

    Attributes:
        name: identifies the model; vectors from different names never mix.
        dim: vector dimension.
    """

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 array of shape ``(len(texts), dim)``."""
