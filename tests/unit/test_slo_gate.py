"""The SLO gate (limits/slo_gate.py) on its own: engines arrive as ids and
ReadyEngine records, nothing from engines/ or gateway/."""

from __future__ import annotations

import pytest

from config.schema import AdaptiveConfig
from limits.interfaces import ReadyEngine
from limits.latency_model import LatencyPrior
from limits.outcome import Outcome, Rejected
from limits.slo_gate import SloGate
from tests.support import ManualClock


def trusted(gate: SloGate, engine_id: str) -> None:
    """A ledger whose model is trusted: 50 ms + 1 ms per prefill token, 20 ms steps."""
    gate.track(engine_id)
    model = gate.ledger(engine_id).model
    model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                step_s=0.02, rel_std=1e-6), min_samples=0)
    model.tpot_rel_error = 0.0
    assert model.confident


def test_ledgers_are_keyed_by_engine_id_and_only_with_adaptive_admission() -> None:
    clock = ManualClock()
    off = SloGate(adaptive=AdaptiveConfig(enabled=False), clock=clock)
    off.track("a")
    assert not off.tracks("a") and off.mode("a", 0.1) is None and off.limit("a", 0.1) is None
    assert off.open_flight("a", "m", 10, 10, "standard", 5) is None
    on = SloGate(adaptive=AdaptiveConfig(), clock=clock)
    on.track("a")
    on.track("b", unmetered_limit=3)  # no KV usage reported: the limiter starts at 3
    assert on.mode("a", 0.1) == "gradient"
    assert on.limit("b", 0.1) == 3
    on.forget("b")
    assert not on.tracks("b") and on.pending_prefill_tokens("b") == 0


def test_a_flight_counts_its_prefill_until_its_first_token_and_feeds_band_demand() -> None:
    clock = ManualClock()
    gate = SloGate(adaptive=AdaptiveConfig(), clock=clock)
    gate.track("a")
    flight = gate.open_flight("a", "m", 700, 1000, "interactive", 10)
    assert flight is not None and gate.pending_prefill_tokens("a") == 700
    clock.t += 0.2
    gate.first_token("a", flight)
    assert gate.pending_prefill_tokens("a") == 0 and gate.decoding("a") == 1
    clock.t += 0.8
    gate.close_flight("a", "m", flight)
    assert gate.decoding("a") == 0 and gate.ledger("a").in_flight == 0
    assert gate.band_demand("m").service_s("interactive") > 0
    gate.drop_model("m")
    assert "m" not in gate.demand


def test_admit_answers_engine_ids_and_sheds_a_request_that_can_no_longer_start_in_time() -> None:
    clock = ManualClock()
    gate = SloGate(adaptive=AdaptiveConfig(), clock=clock, retry_after=lambda m: 7)
    trusted(gate, "a")
    trusted(gate, "b")
    ready = [ReadyEngine("a", 0), ReadyEngine("b", 0)]
    budget = gate.ttft_budget_s("interactive", arrived=0.0, now=0.0)  # the whole 1 s
    assert gate.admit("m", "interactive", budget, ready, ["b", "a"], lambda e: 100) == ["b", "a"]
    # 0.99 s already waited: even an idle engine starts it past its 1 s TTFT target
    late = gate.ttft_budget_s("interactive", arrived=0.0, now=0.99)
    with pytest.raises(Rejected) as e:
        gate.admit("m", "interactive", late, ready, ["a", "b"], lambda e: 100)
    assert e.value.outcome is Outcome.OVERLOADED and e.value.reason == "predicted_miss"
    assert e.value.retry_after_s == 7


def test_a_split_request_is_shed_only_when_observed_and_late() -> None:
    gate = SloGate(adaptive=AdaptiveConfig(), clock=ManualClock(), retry_after=lambda m: 2)
    assert not gate.sheddable("interactive", observed=False, alone_s=0.1)
    assert not gate.sheddable("interactive", observed=True, alone_s=5.0)  # too long alone
    assert gate.sheddable("interactive", observed=True, alone_s=0.1)
    gate.check_start("m", "interactive", budget_s=0.5, predicted_s=0.4)  # in time
    with pytest.raises(Rejected) as e:
        gate.check_start("m", "interactive", budget_s=0.5, predicted_s=0.6)
    assert e.value.reason == "predicted_miss" and e.value.retry_after_s == 2
    shed = gate.prefill_shed("m", "standard")
    assert shed.reason == "predicted_miss" and shed.outcome is Outcome.OVERLOADED


def test_a_batch_request_goes_only_where_the_next_online_request_still_starts_in_time() -> None:
    """The least urgent band's request takes an engine only while an interactive
    request as long, sent right after it, is predicted to start within the 1 s
    interactive TTFT target (model: 50 ms + 1 ms per prefill token ahead)."""
    clock = ManualClock()
    gate = SloGate(adaptive=AdaptiveConfig(), clock=clock)
    trusted(gate, "a")
    trusted(gate, "b")
    ready = [ReadyEngine("a", 0), ReadyEngine("b", 0)]
    budget = gate.ttft_budget_s("batch", arrived=0.0, now=0.0)
    # before any online arrival the batch band has no one to leave room for
    flight = gate.open_flight("b", "m", 500, 500, "batch", 10)  # 500 tokens pending on b
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 300) == ["a", "b"]
    gate.arrived("m", "interactive")
    clock.t += 1.0
    # a: 0.05 + 2 x 0.3 = 0.65 s; b: 0.05 + 0.5 + 0.6 = 1.15 s > 1 s
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 300) == ["a"]
    # a longer line: 0.05 + 2 x 0.5 = 1.05 s on a too; the line waits
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 500) == []
    # the online bands themselves are not held back by it
    assert gate.admit("m", "standard", gate.ttft_budget_s("standard", 1.0, 1.0), ready,
                      ["a", "b"], lambda e: 300) == ["a", "b"]
    gate.first_token("b", flight)  # b's prefill done: it may take the line again
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 300) == ["a", "b"]


def test_an_engine_not_yet_learned_takes_a_batch_request_only_with_no_prefill_pending() -> None:
    """A gateway just started knows no engine's TTFT yet: a batch-band request goes
    only where no prefill is pending, so an online request sent after it waits behind
    that one prefill at most (not behind a batch's first lines sent together)."""
    clock = ManualClock()
    gate = SloGate(adaptive=AdaptiveConfig(), clock=clock)
    gate.track("a")
    gate.track("b")
    assert not gate.ledger("a").model.ttft_trusted
    ready = [ReadyEngine("a", 0), ReadyEngine("b", 0)]
    gate.arrived("m", "interactive")
    clock.t += 1.0
    budget = gate.ttft_budget_s("batch", arrived=1.0, now=1.0)
    assert gate.starts_after_one("a", 300, 1.0) is True
    line = gate.open_flight("a", "m", 300, 300, "batch", 10)  # a streamed line on a
    assert gate.starts_after_one("a", 300, 1.0) is False
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 300) == ["b"]
    gate.first_token("a", line)
    assert gate.admit("m", "batch", budget, ready, ["a", "b"], lambda e: 300) == ["a", "b"]
    assert gate.starts_after_one("nobody", 300, 1.0) is None
