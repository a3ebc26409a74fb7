"""The prefix index: which prompt blocks each engine was sent recently, hence
probably holds in its KV cache (docs/architecture.md, "One request", step 10).

The router cannot see an engine's cache, so it keeps its own approximation, as
SGLang's router keeps an approximate radix tree per worker (``sgl-router``
``cache_aware`` policy, "approximate tree") and llm-d's inference scheduler keeps an
LRU of block hashes per server (``prefix-cache-scorer``, ``lruCapacityPerServer``).
With ``scheduler.prefix.source: events`` the engines' own KV-cache events make it
exact (:mod:`engines.prefix_events`); this index then stands in for an engine whose
events are not in sync and keeps the routes not yet reported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.pool import Engine

#: Bytes one entry may cost in CPython 3.11: an ``OrderedDict`` slot and node, the
#: spare room hash tables keep under insert/evict churn, and the 64-bit ``int`` key
#: (the value, a float timestamp, is one object shared by all blocks of a dispatch).
#: Measured with ``tracemalloc`` (``tests/unit/test_prefix_index.py``): 250–460 B at
#: caps of 4–16 MiB; below ~2 MiB fixed overheads dominate. Rounded up.
ENTRY_BYTES = 512


@dataclass
class _EngineBlocks:
    generation: int
    lru: OrderedDict[int, float] = field(default_factory=OrderedDict)


class PrefixIndex:
    """Per engine, a bounded LRU of the chained block hashes dispatched to it.

    Algorithm: :meth:`record` inserts a dispatched prompt's blocks tail first, head
    last, each stamped ``now`` (an existing entry moves to the most-recent end). A
    prompt's head is therefore always at least as recent as its tail — vLLM frees a
    finished request's blocks tail first for the same reason
    (``vllm/v1/core/kv_cache_manager.py``, ``free``) — and eviction, which takes the
    least recent entries, never leaves block *i* without block *i−1*. Blocks are
    chained (block *i*'s hash covers blocks 0..*i*), so the set an engine holds is
    prefix-closed and :meth:`match` finds the longest held prefix by binary search:
    O(log n) dictionary lookups per engine.

    Bounds:

    * entries older than ``ttl_s`` count as absent and are dropped on the next
      insert (the engine has likely evicted them);
    * an engine keeps at most as many blocks as its KV cache has
      (``num_blocks × block_size`` tokens from its metrics, converted to the
      request's block size) — more could not all be cached there;
    * all engines together keep at most ``max_bytes / ENTRY_BYTES`` entries; past
      that the engine with the most entries loses its least recent ones;
    * when an engine's ``generation`` changes (a restart: its cache is empty) its
      entries are dropped.

    Args:
        max_bytes: memory cap of all entries, bytes (default 64 MiB ≈ 131k blocks,
            ≈ 2.1M tokens at block size 16).
        ttl_s: entry lifetime, s (default 600).
    """

    def __init__(self, max_bytes: int = 64 << 20, ttl_s: float = 600.0) -> None:
        if max_bytes < ENTRY_BYTES or ttl_s <= 0:
            raise ValueError("need max_bytes >= ENTRY_BYTES and ttl_s > 0")
        self.max_entries = max_bytes // ENTRY_BYTES
        self.ttl_s = ttl_s
        self._engines: dict[str, _EngineBlocks] = {}
        self._total = 0

    def __len__(self) -> int:
        """Entries over all engines."""
        return self._total

    def entries(self, engine_id: str) -> int:
        e = self._engines.get(engine_id)
        return len(e.lru) if e else 0

    def _current(self, engine: Engine) -> _EngineBlocks | None:
        e = self._engines.get(engine.id)
        if e is not None and e.generation != engine.generation:
            self.forget(engine.id)
            return None
        return e

    def forget(self, engine_id: str) -> None:
        """Drop everything recorded for ``engine_id``."""
        e = self._engines.pop(engine_id, None)
        if e is not None:
            self._total -= len(e.lru)

    def match(self, engine: Engine, blocks: Sequence[int], now: float) -> int:
        """How many leading ``blocks`` ``engine`` holds (fresh, same generation)."""
        e = self._current(engine)
        if e is None or not blocks:
            return 0
        lru, oldest = e.lru, now - self.ttl_s
        lo, hi = 0, len(blocks)  # invariant: blocks[:lo] held; blocks[:hi+1] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = lru.get(blocks[mid - 1])
            if t is not None and t >= oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, engine: Engine, blocks: Sequence[int], now: float,
               block_size: int | None = None) -> None:
        """Note that ``blocks`` were sent to ``engine`` at ``now``.

        Args:
            block_size: tokens per block of ``blocks``; with the engine's reported
                geometry it bounds the engine's entries to its KV capacity.
        """
        if not blocks:
            return
        e = self._current(engine)
        if e is None:
            e = self._engines[engine.id] = _EngineBlocks(engine.generation)
        lru = e.lru
        before = len(lru)
        for h in reversed(blocks):
            lru[h] = now
            lru.move_to_end(h)
        oldest = now - self.ttl_s
        while lru and next(iter(lru.values())) < oldest:
            lru.popitem(last=False)
        if block_size and engine.num_blocks and engine.block_size:
            cap = max(1, engine.num_blocks * engine.block_size // block_size)
            while len(lru) > cap:
                lru.popitem(last=False)
        self._total += len(lru) - before
        while self._total > self.max_entries:
            largest = max(self._engines.values(), key=lambda x: len(x.lru)).lru
            for _ in range(min(self._total - self.max_entries, len(largest))):
                largest.popitem(last=False)
                self._total -= 1
