"""``python -m loadtest semcache --json PATH [--limit N]``: precision, recall and
lookup latency of the semantic cache on labelled question pairs.

Data: ``semcache/gptcache_similiar_qqp_full.json`` (GPTCache's copy of Quora Question
Pairs; label 1 = same question) under ``$SLUICE_DATA_DIR`` or ``../shared/data``
relative to the repository.

Quality — each pair is one cache scope: ``text_a`` is stored, ``text_b`` is looked up.
A hit is ``cosine ≥ threshold`` and (for Sluice, not the baseline) the guards of
:mod:`cache.guards` — exactly the decision :meth:`SemanticCache.lookup` takes when the
scope holds ``text_a``. ``precision`` = label-1 hits / hits, ``recall`` = label-1 hits
/ label-1 pairs, ``false_hit_rate`` = label-0 hits / label-0 pairs. ``--limit`` pairs
are drawn at random (seed 0) and split in half: the *calibration* half picks the
shipped threshold (the lowest grid threshold whose guarded precision reaches
``--target-precision`` on at least 50 true hits, else the most precise such point),
every reported figure comes from the other, *test* half.
``baseline`` is the same embedding with a plain cosine threshold and no guards (a
GPTCache-style cache); ``baseline_recall_at_precision`` is its best recall, on the
test half, at any threshold whose precision is at least Sluice's test precision
(again on at least 50 true hits).

Latency — :meth:`SemanticCache.lookup` end to end (embedding in its worker thread,
index search and guards in the index thread), one request at a time, for test
questions (``--queries`` distinct ones per size, so the embedder's recent-vector
cache never answers) against one scope of 1,000 and of 100,000 entries. The 1,000 entries are
real embeddings of dataset questions. Embedding 100,000 sentences takes ~15 min here,
so the 100,000-entry scope is every real embedding computed for the quality run plus
copies of them with Gaussian noise (σ = ``--noise``, renormalised; median cosine to
the original is reported) — same distribution of directions, denser clusters.
``lookup_ms`` gives p50/p99 of the total and of its parts: ``embed`` (queue, thread
hop and model), ``encode`` (the model alone), ``search`` (thread hop, HNSW search of
every segment, guards).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from cache.embedder import BatchingEmbedder, MiniLMEmbedder
from cache.guards import compatible, features
from cache.semantic import SemanticCache
from config.schema import SemanticCacheConfig

DATASET = "semcache/gptcache_similiar_qqp_full.json"
#: Thresholds evaluated: 0.70–0.95 by 0.01, then by 0.0025 up to 1.0 (where the
#: precision target is reached).
GRID = [round(float(t), 4)
        for t in (*np.arange(0.70, 0.95, 0.01), *np.arange(0.95, 1.0001, 0.0025))]
#: Precision levels at which both caches' best recall is compared (``recall_at_precision``).
LEVELS = (0.85, 0.90, 0.92, 0.94, 0.95)


def data_dir() -> Path:
    """``$SLUICE_DATA_DIR``, else ``<repo>/../shared/data``."""
    env = os.environ.get("SLUICE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def embed_all(embedder: MiniLMEmbedder, texts: list[str], cache_path: Path | None
              ) -> tuple[np.ndarray, float]:
    """Vectors of ``texts`` in batches of 64 (or from ``cache_path`` if it holds the same
    texts); returns (vectors, seconds spent embedding)."""
    if cache_path is not None and cache_path.exists():
        saved = np.load(cache_path, allow_pickle=True)
        if list(saved["texts"]) == texts:
            return saved["vectors"], float(saved["seconds"])
    t0 = time.perf_counter()
    vectors = np.concatenate([embedder.encode(texts[i:i + 64])
                              for i in range(0, len(texts), 64)])
    seconds = time.perf_counter() - t0
    if cache_path is not None:
        np.savez(cache_path, texts=np.array(texts, dtype=object), vectors=vectors,
                 seconds=seconds)
    return vectors, seconds


def _point(hit: np.ndarray, label: np.ndarray) -> tuple[float, float, float]:
    tp = int((hit & (label == 1)).sum())
    fp = int((hit & (label == 0)).sum())
    precision = tp / (tp + fp) if tp + fp else 1.0
    return precision, tp / max(1, int((label == 1).sum())), fp / max(1, int((label == 0).sum()))


def curve(sim: np.ndarray, ok: np.ndarray, label: np.ndarray) -> list[tuple[float, float, float]]:
    """(threshold, precision, recall) over :data:`GRID`."""
    return [(t, *_point((sim >= t) & ok, label)[:2]) for t in GRID]


def calibrate(points: list[tuple[float, float, float]], target: float, positives: int,
              min_hits: int = 50) -> tuple[float, bool]:
    """Lowest threshold whose precision reaches ``target`` on at least ``min_hits`` true
    hits (``recall × positives``; the last points near 1.0 rest on a handful of pairs,
    where QQP's label noise swings precision either way). If no point reaches the
    target, the most precise point with enough hits (the lowest such threshold on a
    tie). Returns (threshold, whether the target was reached)."""
    supported = [(t, p) for t, p, r in points if r * positives >= min_hits]
    for t, p in supported:
        if p >= target:
            return t, True
    best = max(p for _, p in supported)
    return next(t for t, p in supported if p == best), False


def quality(pairs: list[dict[str, Any]], vec: dict[str, np.ndarray], target: float
            ) -> dict[str, Any]:
    """Calibrate on the first half of ``pairs``, report on the second."""
    sim = np.array([float(vec[p["text_a"]] @ vec[p["text_b"]]) for p in pairs])
    ok = np.array([compatible(features(p["text_a"]), features(p["text_b"])) for p in pairs])
    label = np.array([int(p["label"]) for p in pairs])
    half = len(pairs) // 2
    cal, test = slice(0, half), slice(half, None)
    cal_curve = curve(sim[cal], ok[cal], label[cal])
    threshold, reached = calibrate(cal_curve, target, int((label[cal] == 1).sum()))
    precision, recall, false_hit = _point((sim[test] >= threshold) & ok[test], label[test])
    base_curve = curve(sim[test], np.ones(len(label[test]), bool), label[test])
    test_curve = curve(sim[test], ok[test], label[test])
    positives = int((label[test] == 1).sum())

    def best_recall(points: list[tuple[float, float, float]], level: float
                    ) -> tuple[float | None, float]:
        ok_points = [(t, r) for t, p, r in points if p >= level and r * positives >= 50]
        return max(ok_points, key=lambda tr: tr[1]) if ok_points else (None, 0.0)

    base_t, base_r = best_recall(base_curve, precision)
    return {
        "pairs": {"calibration": half, "test": len(pairs) - half,
                  "test_label1": int((label[test] == 1).sum())},
        "target_precision": target,
        "threshold": threshold,
        "calibration": {"target_reached": reached,
                        "precision": dict((t, round(p, 4)) for t, p, _ in cal_curve)[threshold]},
        "precision": round(precision, 4), "recall": round(recall, 4),
        "false_hit_rate": round(false_hit, 4),
        "curve": [(t, round(p, 4), round(r, 4)) for t, p, r in test_curve],
        "recall_at_precision": {
            str(level): {"sluice": round(best_recall(test_curve, level)[1], 4),
                         "baseline": round(best_recall(base_curve, level)[1], 4)}
            for level in LEVELS},
        "guard_pass_rate": {"label1": round(float(ok[test][label[test] == 1].mean()), 4),
                            "label0": round(float(ok[test][label[test] == 0].mean()), 4)},
        "baseline": {"curve": [(t, round(p, 4), round(r, 4)) for t, p, r in base_curve],
                     "threshold_at_precision": base_t},
        "baseline_recall_at_precision": round(base_r, 4),
        "recall_ratio": round(recall / base_r, 3) if base_r else None,
    }


def _pcts(samples: list[float]) -> dict[str, float]:
    return {"p50": round(float(np.percentile(samples, 50)), 3),
            "p99": round(float(np.percentile(samples, 99)), 3)}


async def latency(embedder: MiniLMEmbedder, vectors: np.ndarray, queries: list[str],
                  sizes: list[int], noise: float) -> dict[str, Any]:
    """Lookup latency against one scope filled to each of ``sizes`` entries."""
    rng = np.random.default_rng(1)
    cfg = SemanticCacheConfig(max_entries_per_scope=max(sizes), max_total_entries=max(sizes))
    batching = BatchingEmbedder(embedder)
    cache = SemanticCache(batching, cfg)
    out: dict[str, Any] = {}
    filled = 0
    try:
        per_size = len(queries) // len(sizes)
        for size_no, size in enumerate(sorted(sizes)):
            t0 = time.perf_counter()
            while filled < size:
                if filled < len(vectors):
                    take = min(size - filled, len(vectors) - filled, 10_000)
                    base = vectors[filled:filled + take]
                else:
                    take = min(size - filled, 10_000)
                    base = vectors[rng.integers(0, len(vectors), take)]
                    base = base + rng.normal(0, noise, base.shape).astype(np.float32)
                    base /= np.linalg.norm(base, axis=1, keepdims=True)
                await cache.preload("bench", base, [f"entry {filled + i}" for i in range(take)],
                                    [str(filled + i) for i in range(take)])
                filled += take
            build_s = time.perf_counter() - t0
            total, parts = [], {"embed": [], "encode": [], "search": []}
            for q in queries[size_no * per_size:(size_no + 1) * per_size]:
                t = time.perf_counter()
                await cache.lookup("bench", q, 0.0)
                total.append((time.perf_counter() - t) * 1e3)
                for name in ("embed", "search"):
                    parts[name].append(cache.timings_ms[name])
                parts["encode"].append(batching.encode_ms)
            out[str(size)] = {"entries": len(cache), "lookups": len(total),
                              "total": _pcts(total),
                              **{name: _pcts(v) for name, v in parts.items()},
                              "fill_s": round(build_s, 1)}
    finally:
        await cache.close()
        await batching.close()
    noisy = vectors[:1000] + rng.normal(0, noise, vectors[:1000].shape)
    noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
    out["noise"] = {"sigma": noise, "median_cosine_to_original":
                    round(float(np.median(np.sum(noisy * vectors[:1000], axis=1))), 4)}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest semcache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the report here")
    ap.add_argument("--limit", type=int, default=20_000,
                    help="pairs used (default 20000; calibrating near 0.99 needs "
                         "≥ ~10000 for 50 true hits)")
    ap.add_argument("--target-precision", type=float, default=0.95)
    ap.add_argument("--sizes", default="1000,100000", help="index sizes for latency")
    ap.add_argument("--queries", type=int, default=300, help="lookups per size")
    ap.add_argument("--noise", type=float, default=0.02, help="σ of the filler noise")
    ap.add_argument("--vectors", type=Path, help="reuse/save embeddings here (.npz)")
    args = ap.parse_args(argv)

    pairs = json.loads((data_dir() / DATASET).read_text())
    picked = np.random.default_rng(0).permutation(len(pairs))[:args.limit]
    pairs = [pairs[i] for i in picked]
    texts = sorted({p[k] for p in pairs for k in ("text_a", "text_b")})
    embedder = MiniLMEmbedder(threads=1)
    vectors, seconds = embed_all(embedder, texts, args.vectors)
    vec = dict(zip(texts, vectors, strict=True))
    report: dict[str, Any] = {
        "dataset": DATASET, "pairs_used": len(pairs),
        "embedding": {"model": embedder.name, "sentences": len(texts),
                      "seconds": round(seconds, 1), "per_s": round(len(texts) / seconds, 1)},
    }
    report.update(quality(pairs, vec, args.target_precision))
    sizes = [int(s) for s in args.sizes.split(",")]
    test_queries = [p["text_b"] for p in pairs[len(pairs) // 2:]][:args.queries * len(sizes)]
    report["lookup_ms"] = asyncio.run(latency(embedder, vectors, test_queries, sizes,
                                              args.noise))
    args.json.write_text(json.dumps(report, indent=1))
    print(f"threshold {report['threshold']}: precision {report['precision']}, recall "
          f"{report['recall']}, false hits {report['false_hit_rate']}; baseline recall at "
          f"that precision {report['baseline_recall_at_precision']} "
          f"(ratio {report['recall_ratio']})")
    for size in sizes:
        lm = report["lookup_ms"][str(size)]
        print(f"lookup @ {size} entries: total p50 {lm['total']['p50']} / p99 "
              f"{lm['total']['p99']} ms; embed p50 {lm['embed']['p50']} (model "
              f"{lm['encode']['p50']}), search+guards p50 {lm['search']['p50']} ms")
    return 0
