"""Protecting a real engine (issue 41): the throughput knee at best effort, the load
the engine does not report, and its KV capacity as the engine has it."""

from __future__ import annotations

import random

import config.schema  # noqa: F401 - first: engines.interfaces alone hits an import cycle
from engines.kinds.llamacpp import parse_slot_tokens
from engines.pool import Engine, EnginePool, EngineState, MetricsSnapshot
from limits.engine_latency import EngineLatency
from limits.latency_model import THROUGHPUT_SHARE, LatencyModel
from limits.saturation import SaturationDetector

#: A CPU engine too slow for a 100 ms TPOT target even alone: 110 ms per step plus
#: 20 ms per sequence in the batch.
STEP_S, PER_SEQ_S = 0.110, 0.020


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def slow_engine_model() -> LatencyModel:
    """A model fitted (noise-free) to that engine at batches 1–32, prompts of 100
    tokens prefilled in 50 ms + 1 ms per token."""
    model = LatencyModel(forgetting=0.995)
    for i in range(200):
        batch = 1 + i % 32
        assert model.observe_tpot(STEP_S + PER_SEQ_S * batch, batch, 0.0, 31)
        assert model.observe_ttft(0.05 + 0.001 * 100, 100, batch - 1)
    model.prefill_per_token = 0.0
    return model


def rate(model: LatencyModel, batch: int) -> float:
    """Predicted tokens/s at ``batch``."""
    return batch / model.predict_tpot(batch).mean


def test_throughput_knee_from_a_fitted_model() -> None:
    model = slow_engine_model()
    assert model.confident
    # b = 0.9 × 110 / (0.1 × 20) = 49.5 → 50
    knee = model.throughput_knee()
    assert knee == 50
    asymptote = 1 / PER_SEQ_S  # 50 tokens/s
    assert rate(model, knee) >= THROUGHPUT_SHARE * asymptote > rate(model, knee - 1)
    # the turnover's prefill per sequence counts in the per-sequence cost: a lower knee
    model.tpot.theta[2] = 0.001  # 1 ms per prefill token in a step
    model.tpot._snapshot()
    model.prefill_per_token = 5.0  # 5 prompt tokens per output token: + 5 ms / seq
    assert model.throughput_knee() < knee
    # no per-sequence cost: the rate grows without bound, the cap holds
    flat = LatencyModel()
    flat.tpot.theta[1:] = 0.0
    flat.tpot._snapshot()
    assert flat.throughput_knee(cap=256) == 256


def test_throughput_knee_holds_while_the_engine_runs_at_one_batch() -> None:
    """Held at its knee the engine shows the fit one batch size only; the fit's
    intercept and slope then trade off (noise moves them along the line through the
    operating point), but the knee, from the engine's speed alone and TPOT̂ where it
    runs, stays put."""
    model = slow_engine_model()
    rng = random.Random(7)
    knees = []
    for _ in range(400):
        tpot = (STEP_S + PER_SEQ_S * 50) * rng.uniform(0.9, 1.1)
        model.observe_tpot(tpot, 50, 0.0, 31)
        knees.append(model.throughput_knee())
    assert all(40 <= k <= 60 for k in knees), (min(knees), max(knees))


def test_best_effort_holds_the_engine_at_its_throughput_knee() -> None:
    clock = Clock()
    eng = EngineLatency(slow_engine_model(), clock, z=2.0)
    assert eng.best_effort(0.1) and eng.mode(0.1) == "best_effort"
    assert eng.limit(0.1) == 50
    flights = [eng.sent(0, 100, 0.1) for _ in range(49)]
    v = eng.decide(100, ttft_budget_s=10.0, tpot_target_s=0.1, elsewhere=False)
    assert v.admit and v.best_effort
    flights.append(eng.sent(0, 100, 0.1))
    v = eng.decide(100, ttft_budget_s=10.0, tpot_target_s=0.1, elsewhere=False)
    assert not v.admit and v.reason == "throughput" and not v.best_effort
    # other clients' requests on the engine count too
    for f in flights[:20]:
        eng.finished(f, ok=False)
    assert eng.in_flight == 30
    assert eng.decide(100, 10.0, 0.1, elsewhere=False).admit
    assert not eng.decide(100, 10.0, 0.1, reported_load=50, elsewhere=False).admit


def engine(in_flight: int, running: int, waiting: int, *, at_send: int | None = None,
           signals: frozenset[str] = frozenset({"kv_usage", "running", "waiting"})) -> Engine:
    """An engine whose last scrape read ``running``/``waiting`` while this gateway had
    ``at_send`` (default ``in_flight``) requests on it when sending the scrape and
    ``in_flight`` when storing it (and now)."""
    pool = EnginePool()
    e = Engine("e0", "m", "http://127.0.0.1:1", state=EngineState.READY, in_flight=in_flight)
    pool.add(e)
    pool.set_metrics(e, MetricsSnapshot(at=100.0, kv_cache_usage=0.1, num_running=running,
                                        num_waiting=waiting, signals=signals),
                     in_flight if at_send is None else at_send)
    return e


def test_requests_the_engine_does_not_report_count_as_waiting() -> None:
    """The flood seen on the packaged vLLM engine: 500 of the gateway's requests on it,
    the engine reporting 1 running and 0 waiting (the rest in its API server)."""
    detector = SaturationDetector(max_waiting=4, stale_s=5.0)
    flood = engine(500, running=1, waiting=0)
    assert flood.unreported == 499
    assert not detector.admits(flood, "interactive", 100, now=101.0)
    # all reported: nothing unreported, admitted (the engine's own queue is empty)
    steady = engine(8, running=8, waiting=0)
    assert steady.unreported == 0 and detector.admits(steady, "interactive", 100, 101.0)
    # a few in the front end at the scrape are within max_waiting
    assert engine(12, running=8, waiting=0).unreported == 4
    assert detector.admits(engine(12, running=8, waiting=0), "interactive", 100, 101.0)
    assert not detector.admits(engine(13, running=8, waiting=0), "interactive", 100, 101.0)
    # reported waiting and unreported add up
    assert not detector.admits(engine(12, running=6, waiting=3), "interactive", 100, 101.0)
    # sent during the scrape's round trip: not yet counted (the next scrape tells)
    assert engine(9, running=4, waiting=0, at_send=4).unreported == 0
    # finished during the round trip: not counted as unreported either
    assert engine(4, running=6, waiting=0, at_send=6).unreported == 0
    # the flood seen from one scrape to the next
    assert engine(500, running=2, waiting=0, at_send=480).unreported == 478
    # requests sent after the scrape count from the next one
    later = engine(8, running=8, waiting=0)
    later.in_flight = 30
    assert later.unreported == 0
    # llama.cpp: busy slots and deferred tasks are its running and waiting
    llama = engine(40, running=4, waiting=0, signals=frozenset({"running", "waiting"}))
    assert llama.unreported == 36
    # a dialect with no running count (a bare OpenAI server) has nothing to compare
    assert engine(40, running=0, waiting=0, signals=frozenset()).unreported == 0


def test_kv_capacity_is_the_engines_own_figure() -> None:
    e = engine(0, 0, 0)
    e.metrics = MetricsSnapshot(at=1.0, block_size=128, num_blocks=55_356 // 128,
                                kv_tokens=55_356)
    assert e.kv_capacity_tokens == 55_356  # the engine's figure, not 432 blocks x 128
    # llama.cpp: one slot's context is what one request may fill
    props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 2048}}
    assert parse_slot_tokens(props) == 2048
    assert parse_slot_tokens({"total_slots": 4}) is None
    assert parse_slot_tokens({"default_generation_settings": {"n_ctx": True}}) is None
    e.slot_tokens = 2048
    assert e.kv_capacity_tokens == 2048
