"""Scheduler plugins and the explicit registry that builds them from YAML.

Each role has an immutable mapping from the kebab-case ``type`` used in
``engines.yaml`` to a class. Every class names its typed parameters as ``Params``, the
pydantic model :mod:`config.plugins` registers for its type (:class:`NoParams` when it
has none); the configuration schema validates ``type`` and ``params`` against that
registry when the file loads, and :func:`build_filter`, :func:`build_scorer` and
:func:`build_picker` construct the plugin with ``cls(params=Params(**params))``, or
``cls()`` when it has none (pickers also get the scheduler's ``rng``). To add a plugin, write a class that
satisfies the protocol in :mod:`engines.interfaces`, add it to the mapping of its
role below and its type (with its ``Params``) to :mod:`config.plugins`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from config.plugins import KvWatermarkParams, LoadGuardParams, MaxScoreParams, NoParams
from config.schema import PluginConfig
from engines.interfaces import Filter, Picker, SchedRequest, Scorer
from engines.pool import Engine


def engine_load(engine: Engine) -> int:
    """Requests on ``engine``: this gateway's in-flight count (exact and current) plus
    the other clients' requests in the engine's last report (its running + waiting
    less this gateway's share of it, :attr:`~engines.pool.Engine.in_flight_at_metrics`;
    up to one metrics interval old). Taking the report whole would hold a slot this
    gateway's finished request left until the next scrape; adding it whole would count
    this gateway's requests twice."""
    m = engine.metrics
    others = m.num_running + m.num_waiting - engine.in_flight_at_metrics if m else 0
    return engine.in_flight + max(0, others)


# --------------------------------------------------------------------------- filters


class KvWatermark:
    """Keeps engines whose KV-cache usage is under ``watermark`` (fraction 0–1,
    default 0.8); engines that have not reported usage are kept.

    This is the scheduler's *preference* to leave headroom (an engine near a full
    KV cache preempts running requests, vLLM's recompute preemption); the limits
    ``SaturationDetector`` has already removed engines at its hard watermark (0.9).
    If every candidate is over, the scheduler falls back to the healthy list. Source:
    llm-d inference scheduler's KV-cache-utilisation filter and the "low KV-cache
    headroom" filter of the Gateway API Inference Extension (``kvCacheThreshold``,
    0.8 by default).
    """

    Params = KvWatermarkParams

    def __init__(self, params: Params | None = None) -> None:
        self.watermark = (params or self.Params()).watermark

    def filter(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[Engine]:
        return [e for e in engines
                if e.kv_cache_usage is None or e.kv_cache_usage < self.watermark]


class LoadGuard:
    """Removes engines whose load has diverged from the least-loaded candidate's, so
    that no affinity can pile more requests on them.

    Load is :func:`engine_load` (requests running + waiting). With ``low`` the
    smallest candidate load, an engine is dropped when its load exceeds
    ``low + max(abs_threshold, rel_threshold × low)``. Affinity then yields exactly
    for the overloaded engines while the rest of the policy runs unchanged; once the
    loads converge, affinity applies again.

    Source: SGLang router's cache-aware policy (``sgl-router``, ``cache_aware.rs``)
    switches to shortest-queue routing when ``max_load − min_load >
    balance_abs_threshold`` and ``max_load > balance_rel_threshold × min_load``
    (defaults 64 and 1.5 for large GPU fleets); here the test is per engine, so only
    the outliers lose their affinity, and the defaults suit engines running tens of
    requests.

    Args:
        abs_threshold: allowed excess over the least-loaded engine, requests
            (default 4).
        rel_threshold: allowed excess as a fraction of the least load (default 0.25).
    """

    Params = LoadGuardParams

    def __init__(self, params: Params | None = None) -> None:
        params = params or self.Params()
        self.abs_threshold = params.abs_threshold
        self.rel_threshold = params.rel_threshold

    def filter(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[Engine]:
        loads = [engine_load(e) for e in engines]
        if not loads:
            return []
        low = min(loads)
        limit = low + max(self.abs_threshold, self.rel_threshold * low)
        return [e for e, load in zip(engines, loads, strict=True) if load <= limit]


# --------------------------------------------------------------------------- scorers


class PrefixAffinity:
    """Prefers the engine most likely to hold the prompt's prefix in its KV cache.

    Score = (leading prompt blocks the engine holds, per the prefix index) / (blocks
    in the prompt), from ``req.prefix_matches`` (filled by the scheduler); 0 for every
    engine when the prompt has no full block. A hit skips the prefill of the matched
    tokens, the dominant part of TTFT for long prompts (Preble, Srivatsa et al.,
    ICLR 2025; Mooncake, Qin et al., FAST 2025). Source: llm-d inference scheduler's
    ``prefix-cache-scorer`` (matched blocks / total blocks) and SGLang router's
    cache-aware match rate. No parameters.
    """

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        n = len(req.blocks)
        if n == 0:
            return [0.0] * len(engines)
        return [min(req.prefix_matches.get(e.id, 0), n) / n for e in engines]


class KvCacheUsage:
    """Prefers engines with free KV cache: score = ``1 − kv_cache_usage`` (0 when
    the engine has not reported usage). Free blocks admit new requests without
    preempting running ones and keep more of the cached prefixes alive. Source:
    llm-d inference scheduler's ``kv-cache-utilization-scorer``. No parameters."""

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        return [0.0 if e.kv_cache_usage is None else min(max(1.0 - e.kv_cache_usage, 0.0), 1.0)
                for e in engines]


class QueueDepth:
    """Prefers the less loaded engine: score = ``1 − load / max_load`` over the
    candidates, load being :func:`engine_load` (running + waiting requests); every
    engine scores 1 when none has any load. Proportional (not min–max) normalisation:
    engines at 10 and 11 requests score 0.09 and 0, so a small difference only breaks
    ties between equally good prefixes instead of overriding them. Source: llm-d
    inference scheduler's ``queue-scorer`` (waiting queue size) and the
    least-outstanding-requests balancing of Envoy. No parameters."""

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        loads = [engine_load(e) for e in engines]
        busiest = max(loads, default=0)
        if busiest <= 0:
            return [1.0] * len(engines)
        return [1.0 - load / busiest for load in loads]


class SessionAffinity:
    """Sticky sessions: score 1 for the engine the request's session
    (``x-session-id``) last went to, 0 for the others and for requests without a
    session. When that engine is saturated or overloaded the filters (the limits'
    saturation check, ``kv-watermark``, ``load-guard``) have removed it and the other
    scorers decide; the session then sticks to its new engine. Source: sticky
    sessions of HTTP load balancers (e.g. Envoy's ring-hash/Maglev on a header) and
    the session-affinity scorer of llm-d's inference scheduler. No parameters."""

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        target = req.session_engine
        return [1.0 if target is not None and e.id == target else 0.0 for e in engines]


class LeastInFlight:
    """Prefers the engine with the fewest requests this gateway has in flight on it
    (the "least outstanding requests" balancing of NGINX ``least_conn`` and Envoy's
    least-request policy).

    Score = ``1 - in_flight / max_in_flight`` over the candidates, so the busiest
    engine scores 0 and an idle one 1; when no candidate has anything in flight every
    engine scores 1. No parameters.
    """

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        busiest = max((e.in_flight for e in engines), default=0)
        if busiest <= 0:
            return [1.0] * len(engines)
        return [1.0 - max(e.in_flight, 0) / busiest for e in engines]


class PredictedTtft:
    """Prefers the engine predicted to start the request soonest.

    TTFT̂ (s) comes from each engine's fitted latency model
    (:mod:`limits.latency_model`): its uncached prefill tokens already queued plus
    this request's uncached ones — the prompt less the leading blocks the prefix
    index says the engine holds — at the sequences decoding there. Score =
    ``min TTFT̂ / TTFT̂`` over the candidates (proportional, so the fastest engine
    scores 1 and one predicted twice as slow 0.5); every engine scores 1 when none has
    a model. One scorer for what prefix-affinity, queue-depth and speed each say in
    part, in the unit of the SLO: the "estimated TTFT" routing of Llumnix (Sun et al.,
    OSDI 2024) and Preble (Srivatsa et al., ICLR 2025), which weigh cached tokens
    against queued prefill. No parameters.
    """

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        n = len(req.blocks)
        preds: list[float | None] = []
        slo = req.slo
        for e in engines:
            if slo is None:
                preds.append(None)
                continue
            hit = min(req.prefix_matches.get(e.id, 0), n) * req.block_size
            preds.append(slo.predicted_ttft_s(e.id, max(0, req.prompt_tokens - hit)))
        known = [p for p in preds if p is not None and p > 0]
        if not known:
            return [1.0] * len(engines)
        best = min(known)
        return [best / p if p is not None and p > 0 else 0.0 for p in preds]


class PrefillBacklog:
    """Prefers the engine that will compute the request's first token soonest, in
    prefill tokens: the uncached prompt tokens already waiting there plus this
    request's own uncached ones.

    ``cost = pending + max(0, prompt_tokens − hit)`` tokens, ``pending`` being the
    uncached prompt tokens of this gateway's requests on the engine that have not had
    their first token (the SLO gate's request ledger, :mod:`limits.slo_gate`, exact and
    current; 0 for an engine without one, i.e. with adaptive admission off) and
    ``hit`` the leading blocks the prefix index says the engine holds, in tokens.
    Score = ``min cost / cost`` over the candidates (proportional: the engine with the
    least work ahead of the request's first token scores 1, one with twice as much
    0.5); costs are floored at 1 token. An engine that schedules FCFS with chunked
    prefill (vLLM's default) starts the request's first token after that many prefill
    tokens, so on engines of one speed this ranks them by TTFT without a fitted model
    (``predicted-ttft`` converts the same tokens to seconds per engine). Blind to other
    gateway replicas' requests. Source: the prefill cost of NVIDIA Dynamo's KV router
    (active prompt tokens plus the request's uncached ones, decreased when the first
    token signals the end of prefill; docs.nvidia.com/dynamo, "Routing Concepts"),
    and the KVCache-centric scheduling of Mooncake's Conductor, which sends a request to
    the prefill instance with the least queued prefill time plus the prefill time of
    its uncached part (Qin et al., FAST 2025). No parameters.
    """

    Params = NoParams

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        n = len(req.blocks)
        costs = []
        for e in engines:
            hit = min(req.prefix_matches.get(e.id, 0), n) * req.block_size
            pending = req.slo.pending_prefill_tokens(e.id) if req.slo is not None else 0
            costs.append(max(1, pending + max(0, req.prompt_tokens - hit)))
        best = min(costs, default=1)
        return [best / c for c in costs]


class MaxScore:
    """Picks the engine with the highest total score; ties (totals within
    ``tolerance``, default 1e-9) are broken uniformly at random with ``rng``."""

    Params = MaxScoreParams

    def __init__(self, rng: random.Random, params: Params | None = None) -> None:
        self.rng = rng
        self.tolerance = (params or self.Params()).tolerance

    def pick(self, engines: Sequence[Engine], totals: Sequence[float]) -> int:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t >= best - self.tolerance]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)


class RoundRobin:
    """Ignores the scores: the *k*-th pick takes candidate ``k mod n`` (the classic
    cache-blind baseline). ``rng`` is accepted for the uniform picker signature and
    unused."""

    Params = NoParams

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def pick(self, engines: Sequence[Engine], totals: Sequence[float]) -> int:
        i = self._next % len(engines)
        self._next += 1
        return i


FILTERS: Mapping[str, type[Filter]] = MappingProxyType({
    "kv-watermark": KvWatermark,
    "load-guard": LoadGuard,
})
SCORERS: Mapping[str, type[Scorer]] = MappingProxyType({
    "least-in-flight": LeastInFlight,
    "prefix-affinity": PrefixAffinity,
    "kv-cache-usage": KvCacheUsage,
    "queue-depth": QueueDepth,
    "session-affinity": SessionAffinity,
    "predicted-ttft": PredictedTtft,
    "prefill-backlog": PrefillBacklog,
})
PICKERS: Mapping[str, type[Picker]] = MappingProxyType({
    "max-score": MaxScore,
    "round-robin": RoundRobin,
})


def plugin_class(role: str, type_: str) -> type[Any]:
    """The class registered as ``type_`` for ``role`` (``filter``, ``scorer`` or
    ``picker``); its ``Params`` model validates the plugin's ``params``.

    Raises:
        ValueError: unknown type; the message lists the valid ones.
    """
    registry: Mapping[str, type[Any]] = {"filter": FILTERS, "scorer": SCORERS,
                                         "picker": PICKERS}[role]
    cls = registry.get(type_)
    if cls is None:
        valid = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"unknown {role} type {type_!r}; valid types: {valid}")
    return cls


def _build(role: str, cfg: PluginConfig, **extra: Any) -> Any:
    cls = plugin_class(role, cfg.type)
    params = cls.Params.model_validate(cfg.params)
    return cls(**extra) if cls.Params is NoParams else cls(params=params, **extra)


def build_filter(cfg: PluginConfig) -> Filter:
    """The filter named by ``cfg.type`` with its validated ``cfg.params``.

    Raises:
        ValueError: unknown type (the message names it and lists the valid ones).
        pydantic.ValidationError: params the plugin's ``Params`` model rejects
            (the configuration schema has normally rejected them when it loaded).
    """
    return _build("filter", cfg)


def build_scorer(cfg: PluginConfig) -> Scorer:
    """The scorer named by ``cfg.type``. Raises as :func:`build_filter`."""
    return _build("scorer", cfg)


def build_picker(cfg: PluginConfig, rng: random.Random) -> Picker:
    """The picker named by ``cfg.type``, given ``rng`` for random choices. Raises as
    :func:`build_filter`."""
    return _build("picker", cfg, rng=rng)
