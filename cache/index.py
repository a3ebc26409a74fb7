"""Bounded nearest-neighbour index over normalised vectors (cosine = inner product).

:class:`VectorIndex` keeps its entries in a FIFO of *segments*, each a faiss
``IndexHNSWFlat`` (Malkov & Yashunin 2018, "Efficient and robust approximate nearest
neighbor search using HNSW graphs") with the inner-product metric. New entries go to
the newest segment; when the index is full the oldest segment is dropped whole. HNSW
cannot delete single vectors, and dropping a segment is O(1), so eviction is FIFO at
segment granularity: the index holds between ``max_entries - segment_size`` and
``max_entries`` entries once full.

Why HNSW: a flat scan of 100,000 × 384 float32 reads 154 MB per query (~10–15 ms on
one core here), over the 10 ms lookup budget; HNSW with ``ef_search`` 64 answers in
well under 1 ms per segment. Being approximate it may miss the true nearest neighbour;
for a cache that only costs a hit, never a wrong answer, since a hit still needs the
threshold and the guards.

Not thread-safe: the semantic cache calls it from one dedicated worker thread.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# faiss's loader tries its AVX512/AVX2 builds first and logs each missing one at INFO
# with the ModuleNotFoundError (it reads like a traceback); the PyPI wheel here has
# only the generic build, which it then loads. Harmless: its failures stay visible
# (WARNING and above).
logging.getLogger("faiss.loader").setLevel(logging.WARNING)

import faiss  # noqa: E402
import numpy as np  # noqa: E402

T = TypeVar("T")


@dataclass
class _Segment(Generic[T]):
    index: faiss.IndexHNSWFlat
    payloads: list[T] = field(default_factory=list)


class VectorIndex(Generic[T]):
    """FIFO-bounded HNSW index; each vector carries a payload of type ``T``.

    Args:
        dim: vector dimension.
        max_entries: most entries kept.
        segment_size: entries per segment (default ``max(256, ceil(max_entries / 4))``:
            at most 4 full segments searched per query; at 100,000 entries × 384
            dims that measured p50 0.9 ms, against 2.0 ms for 8 segments and 11 ms
            for a flat scan, with the same top-1 as the flat scan on 300 queries).
        hnsw_m: HNSW neighbours per node (faiss ``M``, default 32).
        ef_construction: HNSW build beam (default 40, faiss' default).
        ef_search: HNSW search beam (default 64).
    """

    def __init__(self, dim: int, max_entries: int, segment_size: int | None = None,
                 hnsw_m: int = 32, ef_construction: int = 40, ef_search: int = 64) -> None:
        self.dim = dim
        self.max_entries = max_entries
        self.segment_size = min(max_entries,
                                segment_size or max(256, math.ceil(max_entries / 4)))
        self._m, self._ef_c, self._ef_s = hnsw_m, ef_construction, ef_search
        self._segments: deque[_Segment[T]] = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _new_segment(self) -> _Segment[T]:
        index = faiss.IndexHNSWFlat(self.dim, self._m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self._ef_c
        index.hnsw.efSearch = self._ef_s
        seg: _Segment[T] = _Segment(index)
        self._segments.append(seg)
        return seg

    def add(self, vectors: np.ndarray, payloads: Sequence[T]) -> None:
        """Append ``vectors`` (float32, shape ``(n, dim)``, L2-normalised) with their
        payloads, evicting the oldest segment(s) as needed."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        start = 0
        while start < len(vectors):
            seg = self._segments[-1] if self._segments else None
            if seg is None or len(seg.payloads) >= self.segment_size:
                seg = self._new_segment()
            take = min(len(vectors) - start, self.segment_size - len(seg.payloads))
            while self._size + take > self.max_entries:
                self._size -= len(self._segments.popleft().payloads)
            seg.index.add(vectors[start:start + take])
            seg.payloads.extend(payloads[start:start + take])
            self._size += take
            start += take

    def search(self, vector: np.ndarray, k: int = 4) -> list[tuple[float, T]]:
        """Up to ``k`` nearest entries to ``vector`` as ``(cosine, payload)``, best
        first, newest segment winning ties."""
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)
        found: list[tuple[float, T]] = []
        for seg in reversed(self._segments):
            if not seg.payloads:
                continue
            scores, ids = seg.index.search(query, min(k, len(seg.payloads)))
            found.extend((float(s), seg.payloads[i]) for s, i in zip(scores[0], ids[0], strict=True)
                         if i >= 0)
        found.sort(key=lambda sp: -sp[0])
        return found[:k]
