"""Routing plugins (kv-watermark, load-guard, prefix-affinity, kv-cache-usage,
queue-depth, session-affinity, prefill-backlog, round-robin) and the scheduler's use of its prefix
index and session table; the shipped engines.yaml policy."""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from config.schema import EnginesConfig, FilterConfig, PickerConfig, SchedulerConfig, ScorerConfig
from engines.plugins import (
    FILTERS,
    PICKERS,
    SCORERS,
    KvCacheUsage,
    KvWatermark,
    LoadGuard,
    PrefillBacklog,
    PrefixAffinity,
    QueueDepth,
    RoundRobin,
    SessionAffinity,
    build_filter,
    engine_load,
)
from engines.pool import Engine, EngineState, MetricsSnapshot
from engines.scheduler import SchedRequest, Scheduler
from limits.engine_latency import EngineLatency
from limits.latency_model import LatencyModel
from limits.slo_gate import SloGate
from tests.support import ManualClock

REQ = SchedRequest(model="m", tenant="t", prompt_tokens=10)


def eng(id_: str, in_flight: int = 0, usage: float | None = 0.1, running: int = 0,
        waiting: int = 0, state: EngineState = EngineState.READY) -> Engine:
    e = Engine(id=id_, model="m", base_url=f"http://{id_}", state=state, in_flight=in_flight)
    e.metrics = MetricsSnapshot(at=0.0, kv_cache_usage=usage, num_running=running,
                                num_waiting=waiting, block_size=16, num_blocks=1000)
    return e


def test_registry_names() -> None:
    assert {"kv-watermark", "load-guard"} <= set(FILTERS)
    assert {"prefix-affinity", "kv-cache-usage", "queue-depth", "session-affinity",
            "prefill-backlog"} <= set(SCORERS)
    assert {"max-score", "round-robin"} <= set(PICKERS)
    for cls in (KvWatermark, LoadGuard, PrefixAffinity, KvCacheUsage, QueueDepth,
                SessionAffinity, PrefillBacklog):
        assert "Source" in (cls.__doc__ or ""), cls


def test_engine_load_adds_other_clients_to_the_gateways_own() -> None:
    own = eng("a", in_flight=3, running=2, waiting=1)
    own.in_flight_at_metrics = 3  # the report holds only this gateway's requests
    assert engine_load(own) == 3
    own.in_flight = 2  # one of them finished since: no stale slot held
    assert engine_load(own) == 2
    shared = eng("a", in_flight=1, running=4, waiting=2)
    shared.in_flight_at_metrics = 1  # five of the six are another replica's
    assert engine_load(shared) == 6
    shared.in_flight = 3
    assert engine_load(shared) == 8
    early = eng("a", in_flight=3, running=1, waiting=0)
    early.in_flight_at_metrics = 3  # sent, not yet seen by the engine
    assert engine_load(early) == 3
    assert engine_load(Engine(id="x", model="m", base_url="x")) == 0


def test_kv_watermark_keeps_engines_under_it() -> None:
    es = [eng("a", usage=0.5), eng("b", usage=0.85), eng("c", usage=None)]
    assert [e.id for e in KvWatermark(KvWatermark.Params(watermark=0.8)).filter(REQ, es, 0)] == ["a", "c"]
    assert KvWatermark(KvWatermark.Params(watermark=0.8)).filter(REQ, [eng("b", usage=0.95)], 0) == []


def test_load_guard_drops_only_outliers() -> None:
    g = LoadGuard(LoadGuard.Params(abs_threshold=2, rel_threshold=0.5))
    es = [eng("a", 10), eng("b", 14), eng("c", 16)]  # limit 10 + max(2, 5) = 15
    assert [e.id for e in g.filter(REQ, es, 0)] == ["a", "b"]
    es = [eng("a", 0), eng("b", 2), eng("c", 3)]  # limit 0 + 2
    assert [e.id for e in g.filter(REQ, es, 0)] == ["a", "b"]


def test_prefix_affinity_scores_matched_fraction() -> None:
    req = SchedRequest(model="m", tenant="t", prompt_tokens=64, blocks=(1, 2, 3, 4),
                       prefix_matches={"a": 4, "b": 1})
    assert PrefixAffinity().score(req, [eng("a"), eng("b"), eng("c")], 0) == [1.0, 0.25, 0.0]
    assert PrefixAffinity().score(REQ, [eng("a")], 0) == [0.0]


def test_kv_cache_usage_and_queue_depth_scores() -> None:
    es = [eng("a", usage=0.2), eng("b", usage=0.9), eng("c", usage=None)]
    assert KvCacheUsage().score(REQ, es, 0) == [0.8, 1.0 - 0.9, 0.0]
    es = [eng("a", 0), eng("b", 5), eng("c", running=8, waiting=2)]
    assert QueueDepth().score(REQ, es, 0) == [1.0, 0.5, 0.0]
    assert QueueDepth().score(REQ, [eng("a"), eng("b")], 0) == [1.0, 1.0]


def ledger_eng(id_: str, gate: SloGate, in_flight: int = 0) -> Engine:
    """An engine with the gateway's request ledger in ``gate`` (adaptive admission on)."""
    e = eng(id_, in_flight=in_flight)
    gate.ledgers[id_] = EngineLatency(LatencyModel(), gate.clock)
    return e


def test_prefill_backlog_scores_queued_plus_own_uncached_tokens() -> None:
    gate = SloGate(clock=ManualClock())
    a, b, c = (ledger_eng(x, gate) for x in "abc")
    flight = gate.ledger("b").sent(8000, 8000, 0.1)  # b: 8,000 uncached tokens not prefilled yet
    gate.ledger("c").sent(1000, 1000, 0.1)
    # 4,000 tokens in 4 blocks of 1,000; c holds the first 3 in its prefix cache
    req = SchedRequest(model="m", tenant="t", prompt_tokens=4000, blocks=(1, 2, 3, 4),
                       block_size=1000, prefix_matches={"c": 3}, slo=gate)
    # cost: a 0 + 4000, b 8000 + 4000, c 1000 + 1000 tokens
    assert PrefillBacklog().score(req, [a, b, c], 0) == [0.5, 2000 / 12000, 1.0]
    gate.ledger("b").first_token(flight)  # b's queued prompt is prefilled: it now costs 4,000
    assert PrefillBacklog().score(req, [a, b, c], 0) == [0.5, 0.5, 1.0]
    gate.ledger("b").finished(flight, completion_tokens=10)
    assert PrefillBacklog().score(req, [b], 0) == [1.0]


def test_prefill_backlog_without_a_ledger_or_prompt() -> None:
    req = SchedRequest(model="m", tenant="t", prompt_tokens=0)
    assert PrefillBacklog().score(req, [eng("a"), eng("b")], 0) == [1.0, 1.0]
    req = SchedRequest(model="m", tenant="t", prompt_tokens=64, blocks=(1, 2), block_size=32,
                       prefix_matches={"b": 9})  # a match is capped at the prompt's blocks
    assert PrefillBacklog().score(req, [eng("a"), eng("b")], 0) == [1 / 64, 1.0]


def test_shipped_policy_avoids_a_long_prefill_queue_and_keeps_a_long_prefix() -> None:
    path = Path(__file__).resolve().parents[2] / "config" / "engines.yaml"
    sched = EnginesConfig.model_validate(yaml.safe_load(path.read_text())).scheduler
    s = Scheduler(sched, random.Random(0))
    gate = SloGate(clock=ManualClock())
    s.slo = gate
    # a runs one request with a 60k-token prompt still in prefill; b decodes three
    a, b = ledger_eng("a", gate, in_flight=1), ledger_eng("b", gate, in_flight=3)
    gate.ledger("a").sent(60_000, 60_000, 0.1)
    fresh = SchedRequest(model="m", tenant="t", prompt_tokens=2000, blocks=(7,), block_size=1000)
    assert s.pick(fresh, [a, b], 0).engine is b  # queue-depth alone would choose a
    # a follow-up turn whose 20k-token prefix a holds goes there although a must
    # still prefill 5k tokens: 5k + 2k to compute there, 22k on b
    gate.ledger("a").finished(next(iter(gate.ledger("a").flights)), ok=False)
    gate.ledger("a").sent(5000, 5000, 0.1)
    turn = SchedRequest(model="m", tenant="t", prompt_tokens=22_000,
                        blocks=tuple(range(100, 122)), block_size=1000)
    s.record(turn, a, 0)
    d = s.pick(turn, [a, b], 1)
    assert d.engine is a and d.scores["prefill-backlog"] == 1.0


def test_session_affinity_and_round_robin() -> None:
    req = SchedRequest(model="m", tenant="t", prompt_tokens=1, session_id="s",
                       session_engine="b")
    assert SessionAffinity().score(req, [eng("a"), eng("b")], 0) == [0.0, 1.0]
    assert SessionAffinity().score(REQ, [eng("a"), eng("b")], 0) == [0.0, 0.0]
    rr = RoundRobin(random.Random(0))
    es = [eng("a"), eng("b"), eng("c")]
    assert [rr.pick(es, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def cfg(filters=(), scorers=(), picker="max-score") -> SchedulerConfig:
    return SchedulerConfig(filters=[FilterConfig(type=f) for f in filters],
                           scorers=[ScorerConfig(type=t, weight=w) for t, w in scorers],
                           picker=PickerConfig(type=picker))


def test_scheduler_routes_repeated_prefix_to_the_same_engine() -> None:
    s = Scheduler(cfg(scorers=[("prefix-affinity", 2), ("queue-depth", 1)]), random.Random(3))
    es = [eng("a"), eng("b")]
    req = SchedRequest(model="m", tenant="t", prompt_tokens=64, blocks=(11, 12, 13, 14),
                       block_size=16)
    first = s.pick(req, es, 0).engine
    s.record(req, first, 0)
    first.in_flight += 1  # even a bit busier, the prefix wins
    for t in range(1, 5):
        d = s.pick(req, es, t)
        assert d.engine is first and d.scores["prefix-affinity"] == 1.0


def test_scheduler_load_guard_makes_affinity_yield() -> None:
    s = Scheduler(cfg(filters=["load-guard"], scorers=[("prefix-affinity", 2),
                                                       ("queue-depth", 1)]), random.Random(0))
    a, b = eng("a", in_flight=10), eng("b", in_flight=1)
    req = SchedRequest(model="m", tenant="t", prompt_tokens=64, blocks=(1, 2, 3, 4))
    s.record(req, a, 0)
    assert s.pick(req, [a, b], 1).engine is b


def test_scheduler_session_affinity_and_fallback() -> None:
    s = Scheduler(cfg(filters=["kv-watermark"], scorers=[("session-affinity", 3),
                                                         ("queue-depth", 1)]), random.Random(0))
    a, b = eng("a", in_flight=2), eng("b", in_flight=0)
    req = SchedRequest(model="m", tenant="t", prompt_tokens=4, session_id="conv-1")
    s.record(req, a, 0)
    assert s.pick(req, [a, b], 1).engine is a  # sticky although busier
    a.metrics = MetricsSnapshot(at=1.0, kv_cache_usage=0.95)  # over the watermark
    d = s.pick(req, [a, b], 2)
    assert d.engine is b
    s.record(req, d.engine, 2)
    a.metrics = MetricsSnapshot(at=3.0, kv_cache_usage=0.1)
    assert s.pick(req, [a, b], 3).engine is b  # the session moved with it


def test_scheduler_never_picks_draining_or_dead_engines() -> None:
    s = Scheduler(cfg(scorers=[("prefix-affinity", 5)]), random.Random(0))
    a, b = eng("a"), eng("b", state=EngineState.DRAINING)
    c = eng("c", state=EngineState.UNHEALTHY)
    req = SchedRequest(model="m", tenant="t", prompt_tokens=64, blocks=(1, 2))
    s.record(req, b, 0)
    s.record(req, c, 0)
    assert {s.pick(req, [a, b, c], 1).engine.id for _ in range(20)} == {"a"}


def test_shipped_policy_builds_and_documents_weights() -> None:
    path = Path(__file__).resolve().parents[2] / "config" / "engines.yaml"
    raw = yaml.safe_load(path.read_text())
    sched = EnginesConfig.model_validate(raw).scheduler
    Scheduler(sched)
    types = {s.type for s in sched.scorers} | {f.type for f in sched.filters}
    assert {"prefix-affinity", "queue-depth", "kv-cache-usage", "session-affinity",
            "prefill-backlog", "kv-watermark", "load-guard"} <= types
    assert "weight" in path.read_text() and "#" in path.read_text()
    assert build_filter(FilterConfig(type="load-guard", params={"abs_threshold": 1}))
