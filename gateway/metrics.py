"""Prometheus metrics (``/metrics``), named by Prometheus conventions: base units in
names, ``_total`` counters, ``_seconds`` histograms.

Request-level series are recorded once per finished request from its
:class:`~gateway.record.RequestRecord`; fleet gauges (engines, queues) are read from
the engine pool and the admission queues at scrape time, so nothing is counted twice.
Label cardinality is bounded: ``tenant`` is a configured tenant, ``anonymous`` or
``unknown``; ``model`` a configured model or ``unknown``; ``endpoint`` one of
:data:`gateway.openai_api.PATHS`' keys or ``other`` (a path that is no inference
endpoint); no ids or prompts.

Histogram buckets: TTFT and request duration span 10 ms – 10 min (CPU engines and long
generations), TPOT 5 ms – 1 s (vLLM's own ``vllm:inter_token_latency_seconds`` uses a
similar 10 ms – 2.5 s range, vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.breaker import BreakerState
from engines.kinds import SIGNALS
from engines.pool import Engine, EnginePool, EngineState
from gateway.record import RequestRecord
from limits.admission import AdmissionQueue
from limits.interfaces import CounterStore
from limits.outcome import Outcome
from limits.rate_limit import RateLimiter
from limits.slo_gate import SloGate

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: |TTFT̂ − TTFT| / TTFT: the issue's goals are at 0.2 (p50) and 0.5 (p90).
REL_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)
#: Outcomes counted in ``sluice_rejected_total``: admission control said no (rate
#: limited, shed, queue timeout, no engine, over the tenant's prompt limit). Bad keys
#: and bad requests are not load and show only in ``sluice_requests_total``.
REJECTIONS = {Outcome.RATE_LIMITED, Outcome.EXCEEDS_QUOTA, Outcome.OVERLOADED, Outcome.QUEUE_TIMEOUT,
              Outcome.NO_ENGINE, Outcome.CONTEXT_LENGTH_EXCEEDED}


def rejection_reason(rec: RequestRecord) -> str:
    """``outcome`` or ``outcome:reason`` (e.g. ``rate_limited:tokens_per_min``)."""
    outcome = rec.outcome.value
    return outcome if rec.reason in (None, outcome) else f"{outcome}:{rec.reason}"


def concurrency_limit(engine: Engine, tpot_target_s: float,
                      gate: SloGate | None) -> int | None:
    """The requests in flight ``engine`` may take now: its learned limit in ``gate``
    (:meth:`limits.slo_gate.SloGate.limit` for the ``tpot_target_s`` target, s; at best
    effort its throughput knee), at most its slots where it reports them; None while
    adaptive admission is off."""
    if gate is None or not gate.tracks(engine.id):
        return None
    learned = gate.limit(engine.id, tpot_target_s)
    if learned is None:
        return engine.slots
    return min(learned, engine.slots) if engine.slots else learned


class GatewayMetrics:
    """All of the gateway's series, in a private registry (one per app).

    Args:
        models: configured model names (others are labelled ``unknown``).
        semantic: whether semantic lookups follow exact misses.
    """

    def __init__(self, models: list[str], *, semantic: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.models = set(models)
        self.semantic = semantic
        r = self.registry
        self.requests = Counter("sluice_requests", "Requests by outcome.",
                                ["tenant", "model", "endpoint", "outcome", "status"], registry=r)
        self.duration = Histogram("sluice_request_duration_seconds", "Request duration.",
                                  ["model", "engine"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram("sluice_ttft_seconds", "Time to first token.",
                              ["model", "engine"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sluice_tpot_seconds", "Time per output token after the first.",
                              ["model", "engine"], buckets=TPOT_BUCKETS, registry=r)
        self.ttft_error = Histogram(
            "sluice_predicted_ttft_error", "Relative error |TTFT predicted - TTFT| / TTFT of "
            "the adaptive admission's prediction, streamed requests.", ["model", "engine"],
            buckets=REL_ERROR_BUCKETS, registry=r)
        self.queue_wait = Histogram("sluice_queue_wait_seconds", "Wait in the admission queue.",
                                    ["model", "priority"], buckets=QUEUE_BUCKETS, registry=r)
        self.rejected = Counter("sluice_rejected", "Requests refused, shed or rate limited.",
                                ["tenant", "reason"], registry=r)
        self.degraded = Counter("sluice_degraded", "Degradation actions applied.",
                                ["model", "action"], registry=r)
        self.tokens = Counter("sluice_tokens", "Tokens processed by engines.",
                              ["tenant", "model", "endpoint", "kind"], registry=r)
        self.cached_tokens = Counter("sluice_cached_tokens",
                                     "Tokens answered from the response cache (replayed usage).",
                                     ["tenant", "model", "endpoint", "kind"], registry=r)
        self.overshoot = Counter("sluice_output_overshoot_tokens",
                                 "Completion tokens generated beyond the output tokens reserved.",
                                 ["tenant"], registry=r)
        self.cache = Counter("sluice_cache_lookups", "Response cache lookups.",
                             ["kind", "result"], registry=r)
        self.reloads = Counter("sluice_config_reloads", "Configuration reloads.", ["result"],
                               registry=r)
        #: (metric, label values) -> its child: ``labels()`` validates and locks on
        #: every call, a dict lookup does not (cardinality is bounded, see above)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._prefix: dict[str, list[float]] = {}  # engine id -> [sum of ratios, count]
        #: output tokens per engine id (cost metrics)
        self.output_tokens: dict[str, int] = {}

    def _model(self, model: str | None) -> str:
        return model if model in self.models else "unknown"

    def _series(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, created once."""
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def observe(self, rec: RequestRecord) -> None:
        """Record one finished request."""
        model = self._model(rec.model)
        engine = rec.engine or "none"
        endpoint = rec.endpoint or "other"
        self._series(self.requests, rec.tenant, model, endpoint, rec.outcome.value,
                     str(rec.status)).inc()
        if rec.outcome in REJECTIONS:
            self._series(self.rejected, rec.tenant, rejection_reason(rec)).inc()
        if not rec.inference:
            return
        for action in rec.degraded:
            self._series(self.degraded, model, action.split("=", 1)[0]).inc()
        if rec.cache != "bypass":
            self._series(self.cache, "exact", "hit" if rec.cache == "hit-exact" else "miss").inc()
            if self.semantic and rec.cache != "hit-exact":
                self._series(self.cache, "semantic", "hit" if rec.cache == "hit-semantic" else "miss").inc()
        if rec.queue_s is not None:
            self._series(self.queue_wait, model, rec.priority).observe(rec.queue_s)
        if rec.outcome not in (Outcome.OK, Outcome.CACHE_HIT, Outcome.CLIENT_DISCONNECTED):
            return
        tokens = self.cached_tokens if rec.outcome is Outcome.CACHE_HIT else self.tokens
        self._series(tokens, rec.tenant, model, endpoint, "prompt").inc(rec.prompt_tokens)
        self._series(tokens, rec.tenant, model, endpoint, "completion").inc(rec.completion_tokens)
        if rec.engine and rec.outcome is not Outcome.CACHE_HIT:
            self.output_tokens[rec.engine] = self.output_tokens.get(rec.engine, 0) \
                + rec.completion_tokens
        if rec.overshoot_tokens:
            self._series(self.overshoot, rec.tenant).inc(rec.overshoot_tokens)
        self._series(self.duration, model, engine).observe(rec.duration_s)
        if rec.ttft_s is not None:
            self._series(self.ttft, model, engine).observe(rec.ttft_s)
            if rec.predicted_ttft_s is not None and rec.stream and rec.ttft_s > 0:
                self._series(self.ttft_error, model, engine).observe(
                    abs(rec.predicted_ttft_s - rec.ttft_s) / rec.ttft_s)
        tpot = rec.tpot_s
        if tpot is not None:
            self._series(self.tpot, model, engine).observe(tpot)
        ratio = rec.scores.get("prefix-affinity")
        if rec.engine and ratio is not None:
            acc = self._prefix.setdefault(rec.engine, [0.0, 0.0])
            acc[0] += ratio
            acc[1] += 1

    def prefix_match_ratio(self, engine_id: str) -> float | None:
        """Mean prefix-affinity score (matched leading blocks / prompt blocks, 0–1) of
        the requests routed to ``engine_id``; None before any."""
        acc = self._prefix.get(engine_id)
        return acc[0] / acc[1] if acc and acc[1] else None

    def on_reload(self, result: str) -> None:
        self.reloads.labels(result).inc()

    def set_models(self, models: list[str]) -> None:
        """The configured models after a reload (others are labelled ``unknown``)."""
        self.models = set(models)

    def forget_engine(self, engine: Engine) -> None:
        """``engine`` left the pool: its ``engine``-labelled series and tallies go
        (scraped gauges follow the pool by themselves)."""
        for hist in (self.duration, self.ttft, self.tpot, self.ttft_error):
            # the model label is the model asked for (a fallback model's engine
            # serves another one), so find every series of the engine
            series = {s.labels["model"] for family in hist.collect() for s in family.samples
                      if s.labels.get("engine") == engine.id}
            for model in series:
                hist.remove(model, engine.id)
        self._children.clear()  # the removed series must not be written again
        self._prefix.pop(engine.id, None)
        self.output_tokens.pop(engine.id, None)


class FleetCollector(Collector):
    """Engine and queue gauges, read from live objects at scrape time.

    Args:
        pool: the engine pool.
        queues: the admission queues, ``{model: queue}``.
        metrics: for the per-engine prefix-match ratio.
        store: the rate-limit counter store (its ``failovers`` and ``pending_releases``).
        limiter: the rate limiter (its open reservations and held concurrency slots).
        tpot_target_s: the tightest TPOT target of the SLO bands, s (the target of the
            reported concurrency limit).
        desired_engines: model → engines its arrival rate needs (the capacity model),
            or None when unknown (before start-up or before any request finished).
        prefill_held: engine id → the prefills held at the gateway for it
            (:attr:`gateway.prefill_queue.PrefillQueue.held`).
        gate: the SLO gate (the engines' learned limits, modes and fitted models);
            None: none reported.
    """

    def __init__(self, *, pool: EnginePool, queues: Mapping[str, AdmissionQueue[Any]],
                 metrics: GatewayMetrics, store: CounterStore, limiter: RateLimiter,
                 tpot_target_s: float = 0.1,
                 desired_engines: Callable[[str], float | None] = lambda m: None,
                 prefill_held: Callable[[], Mapping[str, Sized]] = dict,
                 gate: SloGate | None = None) -> None:
        self.pool, self.queues, self.metrics, self.store = pool, queues, metrics, store
        self.gate = gate
        self.prefill_held = prefill_held
        self.limiter = limiter
        self.tpot_target_s = tpot_target_s
        self.desired_engines = desired_engines
        self.started = time.monotonic()

    def _adaptive(self) -> Iterator[Any]:
        limit = GaugeMetricFamily(
            "sluice_engine_concurrency_limit", "Learned requests in flight per engine that "
            "keep the tightest TPOT target (the knee), at most the engine's slots where "
            "it reports them; at best effort its throughput knee.",
            labels=["engine", "model"])
        mode = GaugeMetricFamily(
            "sluice_engine_admission_mode", "1 for the active admission controller: model "
            "(fitted latency model), gradient (fallback limiter) or best_effort (the "
            "engine misses the TPOT target even alone; held at its throughput knee).",
            labels=["engine", "model", "mode"])
        params = GaugeMetricFamily(
            "sluice_engine_latency_param", "Fitted latency-model parameter (s, s/token, "
            "s/sequence, or tokens/token for the turnover ratio; limits.latency_model).",
            labels=["engine", "model", "param"])
        gate = self.gate
        for e in self.pool.engines:
            fitted = None if gate is None else gate.model(e.id)
            if gate is None or fitted is None:
                continue
            cap = concurrency_limit(e, self.tpot_target_s, gate)
            if cap is not None:
                limit.add_metric([e.id, e.model], cap)
            mode.add_metric([e.id, e.model, gate.mode(e.id, self.tpot_target_s)], 1.0)
            for name, value in fitted.params().items():
                params.add_metric([e.id, e.model, name], float(value))
        desired = GaugeMetricFamily(
            "sluice_capacity_desired_engines", "Engines the current arrival rate needs at "
            "the learned per-engine throughput (the HPA metric).", labels=["model"])
        for model in self.queues:
            n = self.desired_engines(model)
            if n is not None:
                desired.add_metric([model], n)
        yield from (limit, mode, params, desired)

    def _cost(self) -> Iterator[Any]:
        """Output tokens per engine-hour and, with ``cost_per_hour``, cost per 1,000
        output tokens, since this gateway started (the cost class of serving metrics)."""
        per_hour = GaugeMetricFamily(
            "sluice_engine_output_tokens_per_hour", "Output tokens per engine-hour since "
            "the gateway started.", labels=["engine", "model"])
        cost = GaugeMetricFamily(
            "sluice_engine_cost_per_1k_output_tokens", "cost_per_hour x hours / output "
            "tokens x 1000, since the gateway started.", labels=["engine", "model"])
        hours = max(time.monotonic() - self.started, 1e-9) / 3600
        for e in self.pool.engines:
            tokens = self.metrics.output_tokens.get(e.id, 0)
            per_hour.add_metric([e.id, e.model], tokens / hours)
            if e.cost_per_hour is not None and tokens:
                cost.add_metric([e.id, e.model], e.cost_per_hour * hours / tokens * 1000)
        yield from (per_hour, cost)

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("sluice_engine_up", "1 if the engine is ready (routable).",
                               labels=["engine", "model", "state"])
        kv = GaugeMetricFamily("sluice_engine_kv_cache_usage_ratio", "KV-cache usage, 0-1.",
                               labels=["engine", "model"])
        running = GaugeMetricFamily("sluice_engine_requests_running", "Requests running.",
                                    labels=["engine", "model"])
        waiting = GaugeMetricFamily("sluice_engine_requests_waiting", "Requests waiting.",
                                    labels=["engine", "model"])
        in_flight = GaugeMetricFamily("sluice_engine_requests_in_flight",
                                      "Requests this gateway has sent and not finished.",
                                      labels=["engine", "model"])
        restarts = CounterMetricFamily("sluice_engine_restarts", "Engine restarts.",
                                       labels=["engine", "model"])
        promised = GaugeMetricFamily("sluice_engine_promised_kv_blocks",
                                     "KV blocks promised to in-flight requests.",
                                     labels=["engine", "model"])
        breaker = GaugeMetricFamily(
            "sluice_engine_breaker_open",
            "1 while the engine's circuit breaker is open or half-open (failed requests).",
            labels=["engine", "model"])
        prefix = GaugeMetricFamily("sluice_engine_prefix_match_ratio",
                                   "Mean prefix-affinity score of routed requests, 0-1.",
                                   labels=["engine", "model"])
        signals = GaugeMetricFamily(
            "sluice_engine_signals", "1 if the engine's latest load metrics held this signal "
            "(engines.kinds.SIGNALS), 0 if missing.", labels=["engine", "signal"])
        for e in self.pool.engines:
            labels = [e.id, e.model]
            read = e.metrics.signals if e.metrics is not None and e.metered else frozenset()
            for signal in SIGNALS:
                signals.add_metric([e.id, signal], 1.0 if signal in read else 0.0)
            up.add_metric([*labels, e.state.value], 1.0 if e.state is EngineState.READY else 0.0)
            if e.kv_cache_usage is not None:
                kv.add_metric(labels, e.kv_cache_usage)
            if e.metrics is not None:
                running.add_metric(labels, e.metrics.num_running)
                waiting.add_metric(labels, e.metrics.num_waiting)
            in_flight.add_metric(labels, e.in_flight)
            promised.add_metric(labels, e.promised_blocks)
            restarts.add_metric(labels, e.restarts)
            breaker.add_metric(labels, 0.0 if e.breaker.state is BreakerState.CLOSED else 1.0)
            ratio = self.metrics.prefix_match_ratio(e.id)
            if ratio is not None:
                prefix.add_metric(labels, ratio)
        depth = GaugeMetricFamily("sluice_queue_depth", "Requests waiting for admission.",
                                  labels=["model", "priority"])
        queued = GaugeMetricFamily("sluice_queue_tokens", "Estimated tokens queued.",
                                   labels=["model"])
        for model, q in self.queues.items():
            for priority, n in q.depth().items():
                depth.add_metric([model, priority], n)
            queued.add_metric([model], q.tokens_queued)
        failovers = CounterMetricFamily("sluice_limits_store_failovers",
                                        "Times the shared counter store became unreachable.")
        failovers.add_metric([], self.store.failovers)
        pending = GaugeMetricFamily(
            "sluice_limits_pending_releases",
            "Concurrency-slot releases waiting for the shared counter store to return "
            "(replayed on recovery; limits.max_pending_releases bounds them).")
        pending.add_metric([], self.store.pending_releases)
        reservations = GaugeMetricFamily(
            "sluice_ratelimit_reservations_open",
            "Rate-limit reservations this process took and has not settled and released.")
        slots = GaugeMetricFamily("sluice_ratelimit_concurrency_slots_held",
                                  "Tenant concurrency slots this process holds.")
        reservations.add_metric([], self.limiter.open_reservations)
        slots.add_metric([], self.limiter.held_slots)
        held = GaugeMetricFamily(
            "sluice_prefill_legs_held", "Prefills waiting at the gateway for room on this "
            "engine (gateway.prefill_queue): split requests' prefill legs on a prefill "
            "engine, whole requests' prompts beyond a decode engine's step budget.",
            labels=["engine", "model"])
        legs = self.prefill_held()
        for e in self.pool.engines:
            if e.id in legs:
                held.add_metric([e.id, e.model], len(legs[e.id]))
        yield from (up, kv, running, waiting, in_flight, promised, restarts, breaker, prefix,
                    signals, depth, queued, failovers, pending, reservations, slots, held)
        yield from self._adaptive()
        yield from self._cost()
