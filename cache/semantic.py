"""Semantic cache: the last user turn compared by meaning, inside an exact scope.

Lookup (``scope``, ``query``, ``threshold``):
    1. with a shared store, catch the scope up with entries other replicas (or this
       one) appended to Redis since the last read (see *Sharing*); an empty scope is
       a miss right here, without embedding;
    2. embed ``query`` (:class:`~cache.embedder.BatchingEmbedder`, worker thread);
    3. search the scope's :class:`~cache.index.VectorIndex` for the ``k`` nearest
       stored questions and return the best one whose cosine similarity is
       ≥ ``threshold`` **and** that :func:`cache.guards.compatible` accepts.

    Step 1's index update and step 3 run on one dedicated index thread that owns every
    index (faiss is not used concurrently, the event loop never blocks on it).

The match names the stored answer by its exact key; the response itself lives in the
:class:`~cache.exact.ExactCache` (one copy, one TTL, one byte cap). An entry whose
answer expired or was evicted is a miss.

Sharing (``redis://``)
    Each scope is a Redis stream ``sluice:cache:s:<embedder>:<scope>`` of entries
    ``{v: float32 vector bytes, q: question, k: exact key}``, trimmed to about
    ``max_entries_per_scope`` (``XADD MAXLEN ~``) and expiring after the longest TTL
    written to it. :meth:`SemanticCache.add` only appends to the stream. Every lookup
    reads the stream after the last id this process has seen (``XRANGE (last +``; one
    round trip, empty when nothing changed), so a scope is loaded lazily on its first
    lookup — by a replica that started later too — and entries written anywhere are
    visible to the next lookup everywhere. Vectors are never recomputed on load.

Memory bounds
    ``max_entries_per_scope`` per index (FIFO), ``max_scopes`` scopes and
    ``max_total_entries`` entries over all scopes (least recently used scopes are
    dropped; with Redis they reload on their next lookup).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import redis.asyncio as aioredis

from cache.embedder import BatchingEmbedder
from cache.guards import Features, compatible, features
from cache.index import VectorIndex
from config.schema import SemanticCacheConfig
from limits.clock import MONOTONIC
from limits.interfaces import Clock

STREAM_PREFIX = "sluice:cache:s:"
_READ_COUNT = 5000


@dataclass(frozen=True)
class _Entry:
    exact: str
    features: Features


@dataclass(frozen=True)
class Match:
    """A semantic hit candidate: the exact key of the stored answer and its cosine
    similarity (0–1) to the query."""

    exact: str
    similarity: float


@dataclass
class _Scope:
    index: VectorIndex[_Entry]
    last_id: str = "0-0"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SemanticCache:
    """See the module docstring.

    Args:
        embedder: the async embedder (its ``name`` is part of the Redis key).
        cfg: bounds (``max_entries_per_scope``, ``max_scopes``, ``max_total_entries``).
        redis: a ``redis.asyncio.Redis`` to share entries through, or None for a
            process-local cache. Not closed by :meth:`close`.
        k: nearest neighbours examined per lookup (default 4).
        clock: times the lookups' stages, s.

    Attributes:
        timings_ms: the last lookup's ``embed``, ``sync`` (Redis catch-up) and
            ``search`` (index + guards) wall times, ms.
    """

    def __init__(self, embedder: BatchingEmbedder, cfg: SemanticCacheConfig,
                 redis: aioredis.Redis | None = None, k: int = 4,
                 clock: Clock = MONOTONIC) -> None:
        self.clock = clock
        self.embedder = embedder
        self.cfg = cfg
        self.redis = redis
        self.k = k
        self.timings_ms: dict[str, float] = {}
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._entries = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-semindex")

    def __len__(self) -> int:
        """Entries held in memory over all scopes."""
        return self._entries

    @property
    def scopes(self) -> int:
        """Scopes held in memory."""
        return len(self._scopes)

    def _stream(self, scope: str) -> str:
        return f"{STREAM_PREFIX}{self.embedder.name}:{scope}"

    def _scope(self, scope: str) -> _Scope:
        state = self._scopes.get(scope)
        if state is None:
            state = _Scope(VectorIndex(self.embedder.dim, self.cfg.max_entries_per_scope))
            self._scopes[scope] = state
            self._evict()
        self._scopes.move_to_end(scope)
        return state

    def _evict(self) -> None:
        while len(self._scopes) > 1 and (len(self._scopes) > self.cfg.max_scopes
                                         or self._entries > self.cfg.max_total_entries):
            _, state = self._scopes.popitem(last=False)
            self._entries -= len(state.index)

    @staticmethod
    def _ingest(index: VectorIndex[_Entry], vectors: np.ndarray, queries: Sequence[str],
                exacts: Sequence[str]) -> int:
        before = len(index)
        index.add(vectors, [_Entry(e, features(q)) for q, e in zip(queries, exacts, strict=True)])
        return len(index) - before

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _add_local(self, scope: str, state: _Scope, vectors: np.ndarray,
                         queries: Sequence[str], exacts: Sequence[str]) -> None:
        added = await self._run(self._ingest, state.index, vectors, queries, exacts)
        if self._scopes.get(scope) is state:  # not evicted meanwhile
            self._entries += added
            self._evict()

    async def _sync(self, scope: str, state: _Scope) -> None:
        """Append to the local index what the scope's stream gained since ``last_id``."""
        assert self.redis is not None
        async with state.lock:
            while True:
                rows = await self.redis.xrange(self._stream(scope), f"({state.last_id}", "+",
                                               count=_READ_COUNT)
                if not rows:
                    return
                state.last_id = rows[-1][0].decode()
                vectors = np.frombuffer(b"".join(f[b"v"] for _, f in rows), dtype=np.float32)
                await self._add_local(scope, state, vectors.reshape(len(rows), -1),
                                      [f[b"q"].decode() for _, f in rows],
                                      [f[b"k"].decode() for _, f in rows])
                if len(rows) < _READ_COUNT:
                    return

    def _best(self, index: VectorIndex[_Entry], vector: np.ndarray, query: str,
              threshold: float) -> Match | None:
        candidates = index.search(vector, self.k)
        if not candidates or candidates[0][0] < threshold:
            return None
        wanted = features(query)
        for score, entry in candidates:
            if score >= threshold and compatible(wanted, entry.features):
                return Match(entry.exact, score)
        return None

    async def lookup(self, scope: str, query: str, threshold: float) -> Match | None:
        """The best stored question in ``scope`` at cosine ≥ ``threshold`` that the
        guards accept, or None. A scope with no entries answers without embedding
        (most multi-turn scopes are unique)."""
        t0 = self.clock.now()
        if self.redis is not None:
            state = self._scope(scope)
            await self._sync(scope, state)
        elif (state := self._scopes.get(scope)) is not None:
            self._scopes.move_to_end(scope)
        t1 = self.clock.now()
        self.timings_ms = {"sync": (t1 - t0) * 1e3, "embed": 0.0, "search": 0.0}
        if state is None or len(state.index) == 0:
            return None
        vector = await self.embedder.embed(query)
        t2 = self.clock.now()
        match = await self._run(self._best, state.index, vector, query, threshold)
        self.timings_ms.update(embed=(t2 - t1) * 1e3, search=(self.clock.now() - t2) * 1e3)
        return match

    async def preload(self, scope: str, vectors: np.ndarray, queries: Sequence[str],
                      exacts: Sequence[str]) -> None:
        """Bulk-add precomputed vectors (shape ``(n, dim)``, normalised) to this
        process' index for ``scope`` without embedding or Redis (benchmarks, warm
        starts from a snapshot)."""
        await self._add_local(scope, self._scope(scope), vectors, queries, exacts)

    async def add(self, scope: str, query: str, exact: str, ttl_s: float) -> None:
        """Remember that ``query`` in ``scope`` is answered by the entry ``exact``;
        with Redis the entry is shared and its stream lives ≥ ``ttl_s`` seconds."""
        vector = await self.embedder.embed(query)
        if self.redis is None:
            await self._add_local(scope, self._scope(scope), vector.reshape(1, -1), [query],
                                  [exact])
            return
        key, ttl_ms = self._stream(scope), max(1, int(ttl_s * 1000))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {"v": vector.astype(np.float32).tobytes(), "q": query, "k": exact},
                      maxlen=self.cfg.max_entries_per_scope, approximate=True)
            pipe.pexpire(key, ttl_ms, nx=True)
            pipe.pexpire(key, ttl_ms, gt=True)
            await pipe.execute()

    async def close(self) -> None:
        """Drop the in-memory indexes and stop the index thread; idempotent."""
        self._scopes.clear()
        self._entries = 0
        self._pool.shutdown(wait=False, cancel_futures=True)
