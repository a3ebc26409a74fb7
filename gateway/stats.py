"""The live stats feed behind ``/dashboard`` (``GET /admin/stats``).

Everything is read from what the gateway already keeps: the Prometheus series of
:class:`~gateway.metrics.GatewayMetrics`, the engine pool, the admission queues and the
reload history. A sampler takes one reading per ``interval_s`` (default 1 s) into
ring buffers of ``samples`` entries (default 300 = 5 min). Latency percentiles are
computed over the last ``window_s`` (default 60 s) from histogram bucket deltas with
linear interpolation inside a bucket — the same estimate as PromQL's
``histogram_quantile`` (prometheus/promql/quantile.go).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Histogram

from config.schema import PRIORITIES
from engines.pool import Engine, EnginePool
from gateway.metrics import GatewayMetrics, concurrency_limit
from gateway.reload import ReloadEvent
from limits.admission import AdmissionQueue
from limits.slo_gate import SloGate

ADMITTED = {"ok", "cache_hit"}
#: Rejections that mean the gateway or its engines are overloaded (``sluice_rejected``
#: reasons start with one of these): shedding. A tenant over its own quota
#: (``rate_limited``, ``exceeds_quota``) or a prompt over its limit is not.
OVERLOAD = ("overloaded", "queue_timeout", "no_engine")
#: Seconds with requests in flight and none finishing after which the headline reads
#: ``STALLED``.
STALL_S = 10.0


def headline(shed_rps: float, queued: int, recent_admitted_rps: Sequence[float],
             engines: Sequence[tuple[int, int | None]], interval_s: float) -> str:
    """The dashboard's headline: ``REJECTING`` while requests are shed for overload
    (:data:`OVERLOAD`; a tenant's own quota does not count), ``STALLED`` when requests
    are in flight but none has finished for :data:`STALL_S` (``recent_admitted_rps``:
    the latest readings, ``interval_s`` apart), ``SATURATED`` when an engine is at its
    concurrency limit (``engines``: (in flight, limit or None) each), ``QUEUEING``
    while requests wait in the queue, else ``OK``."""
    in_flight = sum(f for f, _ in engines)
    window = max(1, round(STALL_S / interval_s))
    recent = list(recent_admitted_rps)[-window:]
    if shed_rps > 0:
        return "REJECTING"
    if in_flight > 0 and len(recent) >= window and not any(recent):
        return "STALLED"
    if any(lim is not None and f >= lim for f, lim in engines):
        return "SATURATED"
    return "QUEUEING" if queued > 0 else "OK"


def _buckets(hist: Histogram) -> list[tuple[float, float]]:
    """Cumulative counts per upper bound, summed over all label sets."""
    acc: dict[float, float] = defaultdict(float)
    for family in hist.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                acc[float(s.labels["le"])] += s.value
    return sorted(acc.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0–1) of cumulative ``(upper bound, count)`` buckets, or None
    when empty; values in the +Inf bucket are reported as the largest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 1.0)
        prev_le, prev_count = le, count
    return prev_le


def _delta(now: list[tuple[float, float]], then: list[tuple[float, float]] | None):
    if not then:
        return now
    old = dict(then)
    return [(le, c - old.get(le, 0.0)) for le, c in now]


def _counter_values(counter: Counter) -> Iterable[tuple[dict[str, str], float]]:
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                yield s.labels, s.value


class StatsFeed:
    """Samples the gateway's state and renders the ``/admin/stats`` JSON.

    Args:
        metrics: the app's metrics.
        pool: the engine pool.
        queues: the admission queues, ``{model: AdmissionQueue}``.
        reloads: the recent :class:`~gateway.reload.ReloadEvent` s, a live collection
            (the reloader's ``history``; empty when no file is watched).
        tpot_target_s: the tightest SLO TPOT target, s (the engines' reported limits).
    """

    def __init__(self, *, metrics: GatewayMetrics, pool: EnginePool,
                 queues: Mapping[str, AdmissionQueue[Any]],
                 reloads: Iterable[ReloadEvent], interval_s: float = 1.0,
                 samples: int = 300, window_s: float = 60.0, tpot_target_s: float = 0.1,
                 gate: SloGate | None = None) -> None:
        self.metrics, self.pool, self.queues, self.reloads = metrics, pool, queues, reloads
        self.gate = gate
        self.interval_s = interval_s
        self._started = time.monotonic()
        self.window = max(1, round(window_s / interval_s))
        self.t: deque[float] = deque(maxlen=samples)
        self.depth: dict[str, deque[int]] = {p: deque(maxlen=samples) for p in PRIORITIES}
        self.admitted_rps: deque[float] = deque(maxlen=samples)
        self.shed_rps: deque[float] = deque(maxlen=samples)
        self._ttft: deque[list[tuple[float, float]]] = deque(maxlen=self.window + 1)
        self._tpot: deque[list[tuple[float, float]]] = deque(maxlen=self.window + 1)
        self._last: tuple[float, float] | None = None
        self._samples = samples
        #: per engine id, its concurrency limit and in-flight count at each reading
        self.engine_series: dict[str, dict[str, deque[float | None]]] = {}
        self.tpot_target_s = tpot_target_s
        #: per engine id, (output tokens per engine-hour, cost per 1k output tokens) at
        #: the last reading, so a snapshot agrees with the page between readings
        self._rates: dict[str, tuple[float | None, float | None]] = {}

    def forget_engine(self, engine: Engine) -> None:
        """``engine`` left the pool: its series leave the feed."""
        self.engine_series.pop(engine.id, None)
        self._rates.pop(engine.id, None)

    def _totals(self) -> tuple[float, float]:
        """Requests admitted and shed for overload (:data:`OVERLOAD`) so far."""
        admitted = sum(v for lab, v in _counter_values(self.metrics.requests)
                       if lab["outcome"] in ADMITTED)
        shed = sum(v for lab, v in _counter_values(self.metrics.rejected)
                   if lab["reason"].split(":")[0] in OVERLOAD)
        return admitted, shed

    def sample(self) -> None:
        """Take one reading (the sampler task calls this every ``interval_s``)."""
        depth = dict.fromkeys(PRIORITIES, 0)
        for q in self.queues.values():
            for p, n in q.depth().items():
                depth[p] += n
        admitted, rejected = self._totals()
        last_a, last_r = self._last or (admitted, rejected)
        self._last = (admitted, rejected)
        self.t.append(time.time())
        for p in PRIORITIES:
            self.depth[p].append(depth[p])
        self.admitted_rps.append((admitted - last_a) / self.interval_s)
        self.shed_rps.append((rejected - last_r) / self.interval_s)
        self._ttft.append(_buckets(self.metrics.ttft))
        self._tpot.append(_buckets(self.metrics.tpot))
        for e in self.pool.engines:
            self._rates[e.id] = (self._per_hour(e.id), self._cost(e.id, e.cost_per_hour))
            series = self.engine_series.setdefault(e.id, {
                "limit": deque([None] * (len(self.t) - 1), maxlen=self._samples),
                "in_flight": deque([None] * (len(self.t) - 1), maxlen=self._samples)})
            series["limit"].append(concurrency_limit(e, self.tpot_target_s, self.gate))
            series["in_flight"].append(e.in_flight)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def _latency(self, hist: Histogram, history: deque, q: float) -> float | None:
        window = _delta(_buckets(hist), history[0] if history else None)
        value = histogram_quantile(q, window)
        return None if value is None else round(value * 1000, 1)

    def _hours(self) -> float:
        return max(time.monotonic() - self._started, 1e-9) / 3600

    def _per_hour(self, engine_id: str) -> float:
        """Output tokens per engine-hour since start."""
        return round(self.metrics.output_tokens.get(engine_id, 0) / self._hours(), 1)

    def _cost(self, engine_id: str, cost_per_hour: float | None) -> float | None:
        """Cost per 1,000 output tokens since start, or None without a price."""
        tokens = self.metrics.output_tokens.get(engine_id, 0)
        if cost_per_hour is None or not tokens:
            return None
        return round(cost_per_hour * self._hours() / tokens * 1000, 6)

    def snapshot(self) -> dict[str, Any]:
        """The feed's JSON (shape documented in ``gateway/static/README`` and the
        dashboard issue)."""
        tenants: dict[str, dict[str, Any]] = {}
        for lab, v in _counter_values(self.metrics.requests):
            if lab["outcome"] in ADMITTED:
                t = tenants.setdefault(lab["tenant"], {"admitted": 0, "rejected": {}})
                t["admitted"] += int(v)
        for lab, v in _counter_values(self.metrics.rejected):
            t = tenants.setdefault(lab["tenant"], {"admitted": 0, "rejected": {}})
            t["rejected"][lab["reason"]] = t["rejected"].get(lab["reason"], 0) + int(v)
        lookups = hits = 0.0
        for lab, v in _counter_values(self.metrics.cache):
            if lab["kind"] == "exact":
                lookups += v
            if lab["result"] == "hit":
                hits += v
        engines = [{
            "id": e.id, "model": e.model, "state": e.state.value,
            "kv_cache_usage": e.kv_cache_usage,
            "running": e.metrics.num_running if e.metrics else 0,
            "waiting": e.metrics.num_waiting if e.metrics else 0,
            "in_flight": e.in_flight, "restarts": e.restarts,
            "kv_capacity_tokens": e.kv_capacity_tokens,
            "limit": concurrency_limit(e, self.tpot_target_s, self.gate),
            "mode": self.gate.mode(e.id, self.tpot_target_s) if self.gate is not None else None,
            "output_tokens_per_hour": self._rates.get(e.id, (None, None))[0],
            "cost_per_1k_output_tokens": self._rates.get(e.id, (None, None))[1],
        } for e in self.pool.engines]
        queued = sum(len(q) for q in self.queues.values())
        status = headline(self.shed_rps[-1] if self.shed_rps else 0.0, queued,
                          self.admitted_rps,
                          [(e["in_flight"], e["limit"]) for e in engines], self.interval_s)
        return {
            "now": time.time(), "interval_s": self.interval_s, "status": status,
            "series": {"t": list(self.t),
                       "queue_depth": {p: list(d) for p, d in self.depth.items()},
                       "admitted_rps": list(self.admitted_rps), "shed_rps": list(self.shed_rps),
                       "engines": {e: {k: list(v) for k, v in d.items()}
                                   for e, d in self.engine_series.items()}},
            "tenants": tenants,
            "engines": engines,
            "latency": {
                "ttft_p50_ms": self._latency(self.metrics.ttft, self._ttft, 0.5),
                "ttft_p99_ms": self._latency(self.metrics.ttft, self._ttft, 0.99),
                "tpot_p50_ms": self._latency(self.metrics.tpot, self._tpot, 0.5),
                "tpot_p99_ms": self._latency(self.metrics.tpot, self._tpot, 0.99),
            },
            "cache": {"lookups": int(lookups), "hits": int(hits),
                      "hit_rate": round(hits / lookups, 4) if lookups else None},
            "reloads": [{"at": r.at, "path": r.path, "result": r.result, "error": r.error}
                        for r in self.reloads],
        }
