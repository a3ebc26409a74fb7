"""The segmented HNSW vector index: nearest neighbours and FIFO bounds."""

from __future__ import annotations

import numpy as np

from cache.index import VectorIndex


def unit(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_finds_the_stored_vector_with_cosine_one():
    vectors = unit(500)
    index: VectorIndex[int] = VectorIndex(16, max_entries=1000, segment_size=128)
    index.add(vectors, list(range(500)))
    for i in (0, 127, 128, 499):
        (score, payload), *_ = index.search(vectors[i], k=3)
        assert payload == i and abs(score - 1.0) < 1e-5
    results = index.search(vectors[7], k=3)
    assert len(results) == 3 and [s for s, _ in results] == sorted((s for s, _ in results),
                                                                   reverse=True)


def test_fifo_eviction_keeps_the_index_bounded_and_drops_the_oldest():
    vectors = unit(1000)
    index: VectorIndex[int] = VectorIndex(16, max_entries=400, segment_size=100)
    for i in range(0, 1000, 50):
        index.add(vectors[i:i + 50], list(range(i, i + 50)))
        assert len(index) == min(i + 50, 400) if i < 400 else 300 <= len(index) <= 400
    assert len(index) >= 300
    (_, newest), *_ = index.search(vectors[999], k=1)
    assert newest == 999
    (_, oldest), *_ = index.search(vectors[0], k=1)
    assert oldest != 0


def test_empty_index_finds_nothing():
    index: VectorIndex[int] = VectorIndex(16, max_entries=10)
    assert index.search(unit(1)[0]) == [] and len(index) == 0
