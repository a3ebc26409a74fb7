"""Replay results → summary (latency percentiles, goodput under an SLO, shed rate by
reason, per-engine load and prefix hit rate) and PNG plots."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Result:
    """One request's outcome (one JSON line of ``--out``); times in ms.
    ``cached_tokens``: prompt tokens the engine served from its prefix cache
    (``usage.prompt_tokens_details.cached_tokens``); ``prefix_tokens``: the gateway's
    prediction of them per index (``x-sluice-prefix-tokens``)."""

    index: int
    tenant: str
    priority: str
    at_s: float
    status: int
    error_code: str | None = None
    queue_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    engine: str | None = None
    prefill_engine: str | None = None
    cached_tokens: int | None = None
    prefix_tokens: dict[str, int] | None = None


@dataclass(frozen=True)
class Slo:
    """Goodput SLO: a request counts if it succeeded with TTFT ≤ ``ttft_ms`` and
    TPOT ≤ ``tpot_ms`` (DistServe's definition of goodput, Zhong et al., OSDI 2024)."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0


@dataclass
class EngineSample:
    """One scrape of an engine during the run: ``t_s`` since start, load =
    running + waiting requests, KV usage 0–1."""

    t_s: float
    running: float
    waiting: float
    kv_usage: float


@dataclass
class EngineStats:
    """One engine over a run: prefix-cache counters and KV transfers it read
    (``vllm:nixl_xfer_time_seconds_count``, ``vllm:nixl_bytes_transferred_sum``)
    as deltas, and its load samples."""

    url: str
    queries_delta: float = 0.0
    hits_delta: float = 0.0
    transfers_delta: float = 0.0
    transfer_bytes_delta: float = 0.0
    samples: list[EngineSample] = field(default_factory=list)


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def index_accuracy(results: list[Result]) -> dict[str, Any] | None:
    """How well each prefix index predicted the engines' prefix-cache hits, over the
    successful requests that report both: per request the overlap is
    ``min(predicted, cached)`` tokens (both are leading-prefix lengths);
    ``precision`` = Σ overlap / Σ predicted, ``recall`` = Σ overlap / Σ cached
    (1.0 when the denominator is 0). The top-level ``precision``/``recall`` are
    those of the index that routed (the first in the header); ``by_index`` has each.
    None when no request reported both."""
    pairs = [(r.prefix_tokens, r.cached_tokens) for r in results
             if r.status == 200 and r.prefix_tokens and r.cached_tokens is not None]
    if not pairs:
        return None
    by_index: dict[str, dict[str, float | int]] = {}
    for name in pairs[0][0]:
        got = [(p[name], c) for p, c in pairs if name in p]
        overlap = sum(min(pr, c) for pr, c in got)
        predicted, cached = sum(pr for pr, _ in got), sum(c for _, c in got)
        by_index[name] = {"precision": overlap / predicted if predicted else 1.0,
                          "recall": overlap / cached if cached else 1.0,
                          "requests": len(got), "predicted_tokens": predicted,
                          "cached_tokens": cached}
    routed = next(iter(pairs[0][0]))
    return {"source": routed, "precision": by_index[routed]["precision"],
            "recall": by_index[routed]["recall"], "by_index": by_index}


def summarize(results: list[Result], engines: list[EngineStats], slo: Slo,
              wall_s: float) -> dict[str, Any]:
    """The report as a JSON-able dict."""
    ok = [r for r in results if r.status == 200 and r.error_code is None]
    good = [r for r in ok if (r.ttft_ms or 0) <= slo.ttft_ms and (r.tpot_ms or 0) <= slo.tpot_ms]
    shed = Counter(f"{r.status}:{r.error_code or ''}" for r in results if r not in ok)
    per_engine = Counter(r.engine for r in ok if r.engine)
    loads = [float(np.mean([s.running + s.waiting for s in e.samples]))
             for e in engines if e.samples]
    hits = sum(e.hits_delta for e in engines)
    queries = sum(e.queries_delta for e in engines)
    return {
        "requests": len(results), "ok": len(ok), "wall_s": wall_s,
        "ttft_ms": _pct([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": _pct([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": _pct([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "queue_ms": _pct([r.queue_ms for r in results if r.queue_ms is not None]),
        "throughput_tok_s": sum(r.completion_tokens or 0 for r in ok) / wall_s if wall_s else 0,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput_rps": len(good) / wall_s if wall_s else 0.0,
        "goodput_fraction": len(good) / len(results) if results else 0.0,
        "shed_rate": {k: v / len(results) for k, v in sorted(shed.items())},
        "requests_per_engine": dict(per_engine),
        "prefix_hit_rate": hits / queries if queries else None,
        "engines": [{"url": e.url, "prefix_hit_rate": (e.hits_delta / e.queries_delta
                                                       if e.queries_delta else None),
                     "mean_load": (float(np.mean([s.running + s.waiting for s in e.samples]))
                                   if e.samples else None)} for e in engines],
        "load_max_over_mean": (max(loads) / float(np.mean(loads))
                               if loads and np.mean(loads) > 0 else None),
        "split_fraction": (sum(1 for r in ok if r.prefill_engine) / len(ok)) if ok else 0.0,
        "kv_transfers": sum(e.transfers_delta for e in engines),
        "kv_bytes_moved": sum(e.transfer_bytes_delta for e in engines),
        "index": index_accuracy(results),
    }


def format_summary(s: dict[str, Any]) -> str:
    def row(name: str, p: dict[str, float | None]) -> str:
        f = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
        return f"{name:8} {f(p['p50'])} {f(p['p90'])} {f(p['p99'])}"

    lines = [f"requests {s['requests']}, ok {s['ok']}, wall {s['wall_s']:.1f} s, "
             f"throughput {s['throughput_tok_s']:.1f} tok/s",
             f"{'ms':8} {'p50':>9} {'p90':>9} {'p99':>9}",
             row("TTFT", s["ttft_ms"]), row("TPOT", s["tpot_ms"]), row("E2E", s["e2e_ms"]),
             f"goodput (TTFT ≤ {s['slo']['ttft_ms']:.0f} ms, TPOT ≤ {s['slo']['tpot_ms']:.0f} ms):"
             f" {s['goodput_rps']:.2f} req/s ({s['goodput_fraction']:.1%})"]
    if s["shed_rate"]:
        lines.append("not ok: " + ", ".join(f"{k} {v:.1%}" for k, v in s["shed_rate"].items()))
    if s.get("kv_transfers"):
        lines.append(f"split {s['split_fraction']:.1%} of requests; KV transfers "
                     f"{s['kv_transfers']:.0f}, {s['kv_bytes_moved'] / 1e9:.1f} GB moved")
    if s["prefix_hit_rate"] is not None:
        lines.append(f"prefix hit rate {s['prefix_hit_rate']:.3f}; load max/mean "
                     f"{s['load_max_over_mean'] or float('nan'):.2f}")
    for name, acc in ((s.get("index") or {}).get("by_index") or {}).items():
        lines.append(f"index {name}: precision {acc['precision']:.3f}, "
                     f"recall {acc['recall']:.3f} ({acc['requests']} requests)")
    return "\n".join(lines)


def plot(results: list[Result], engines: list[EngineStats], out_dir: Path) -> list[Path]:
    """Latency CDFs and per-engine load over time as PNGs in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), strict=False):
        by_prio: dict[str, list[float]] = defaultdict(list)
        for r in results:
            v = getattr(r, key)
            if r.status == 200 and v is not None:
                by_prio[r.priority].append(v)
        for prio, vals in sorted(by_prio.items()):
            v = np.sort(vals)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=prio)
        ax.set_xlabel(key.replace("_ms", " (ms)").upper())
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if any(e.samples for e in engines):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.6))
        for e in engines:
            t = [s.t_s for s in e.samples]
            a1.plot(t, [s.running + s.waiting for s in e.samples], label=e.url)
            a2.plot(t, [s.kv_usage for s in e.samples], label=e.url)
        a1.set_ylabel("running + waiting")
        a2.set_ylabel("KV usage")
        for a in (a1, a2):
            a.set_xlabel("time (s)")
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / "engine_load.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_json(path: str | Path, report: Any) -> None:
    """Write a benchmark's report as indented JSON, creating its folder, and print it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
