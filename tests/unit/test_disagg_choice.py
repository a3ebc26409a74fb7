"""The gateway's disaggregation choice (``gateway.disagg``): protocol bodies, the
prefill-speed estimate, the per-request split decision and the shedding of a split
request predicted to start late."""

from __future__ import annotations

import pytest

from config.schema import AdaptiveConfig, DisaggregationConfig, EnginesConfig, EngineSpec
from engines.pool import Engine, EnginePool, EngineState, MetricsSnapshot
from engines.scheduler import SchedRequest, Scheduler
from gateway.disagg import PREFILL_PARAMS, Disaggregator, PrefillSpeed, decode_body, prefill_body
from gateway.placement import Need, Placer
from limits.outcome import Outcome, Rejected
from limits.saturation import SaturationDetector
from tests.support import ManualClock


def eng(id_: str, role: str, in_flight: int = 0) -> Engine:
    return Engine(id=id_, model="m", base_url=f"http://{id_}", in_flight=in_flight,
                  labels={"role": role})


def test_prefill_body_is_vllm_proxy_shaped():
    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "top_p": 0.9}
    assert prefill_body(body) == {
        "model": "m", "messages": [], "max_completion_tokens": 1, "max_tokens": 1,
        "stream": False, "top_p": 0.9, "kv_transfer_params": dict(PREFILL_PARAMS)}
    assert body["stream"] is True  # the client's body is not modified
    params = {"do_remote_prefill": True, "remote_request_id": "x"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert decode_body(body, None) == body


def test_prefill_speed_learns_from_observations_and_tracks_the_queue():
    speed = PrefillSpeed(prior_s_per_token=1e-4)
    e = eng("p", "prefill")
    assert speed.start(e, 1000) == 0
    assert speed.start(e, 500) == 1000
    assert speed.wait_s(e) == pytest.approx(1500 * 1e-4)
    speed.done(e, 1000, 0, elapsed_s=0.05)  # 50 µs per token observed
    assert speed.c(e) == pytest.approx(1e-4 + 0.2 * (5e-5 - 1e-4))
    speed.done(e, 500, 1000, elapsed_s=None)  # failed: no observation
    assert speed.outstanding["p"] == 0
    assert speed.c(e) == pytest.approx(9e-5)


def test_threshold_policy_splits_exactly_the_long_prompts():
    d = Disaggregator(DisaggregationConfig(policy="threshold", threshold_tokens=512))
    p, dec = eng("p", "prefill"), eng("d", "decode")
    assert d.choose(511, {}, [dec], [p]).prefill is None
    long = d.choose(512, {}, [dec], [p])
    assert (long.prefill, long.decode) == (p, dec)
    assert d.choose(5000, {}, [dec], []).prefill is None  # no prefill engine: local


def test_predicted_policy_keeps_idle_decode_engines_local_and_splits_when_busy():
    cfg = DisaggregationConfig(max_decode_stall_ms=50, prefill_tokens_per_s=10_000)
    d = Disaggregator(cfg)
    p, idle, busy = eng("p", "prefill"), eng("d1", "decode"), eng("d2", "decode", in_flight=3)
    # an idle decode engine: nobody to stall, local is sooner (no transfer)
    assert d.choose(2000, {}, [idle], [p]).prefill is None
    # a busy one: 2000 tokens × 100 µs = 200 ms stall > 50 ms → split
    split = d.choose(2000, {}, [busy], [p])
    assert (split.prefill, split.decode) == (p, busy)
    assert split.ttft_s == pytest.approx(0.2)
    # short prompts stall little: local even on a busy engine
    assert d.choose(400, {}, [busy], [p]).prefill is None


def test_predicted_policy_uses_the_decode_engines_cache_and_the_prefill_queue():
    cfg = DisaggregationConfig(max_decode_stall_ms=50, prefill_tokens_per_s=10_000,
                               kv_bytes_per_token=131072, transfer_gbps=100)
    d = Disaggregator(cfg)
    p, busy = eng("p", "prefill"), eng("d", "decode", in_flight=2)
    # cached on the decode engine: 100 uncached tokens → 10 ms stall, local
    local = d.choose(3000, {"d": 2900}, [busy], [p])
    assert local.prefill is None and local.uncached == 100
    # a split counts the transfer of what the decode engine lacks
    split = d.choose(3000, {}, [busy], [p])
    assert split.ttft_s == pytest.approx(0.3 + 3000 * 131072 * 8 / 100e9)
    # a long prefill queue on the only prefill engine: still split (local not allowed)
    d.speed.start(p, 100_000)
    assert d.choose(3000, {}, [busy], [p]).prefill is p
    # but an idle decode engine beats the queue
    assert d.choose(3000, {}, [busy, eng("d2", "decode")], [p]).decode.id == "d2"


def test_the_sooner_option_wins_local_or_split():
    cfg = DisaggregationConfig(max_decode_stall_ms=200, prefill_tokens_per_s=10_000)
    d = Disaggregator(cfg)
    p, busy = eng("p", "prefill"), eng("d", "decode", in_flight=2)
    d.speed.s_per_token.update(p=5e-5)  # the prefill engine computes twice as fast
    # 1000 tokens (within the 2,000-token step budget): split 50 ms, local 100 ms
    split = d.choose(1000, {}, [busy], [p])
    assert split.prefill is p and split.ttft_s == pytest.approx(0.05)
    # 800 of them cached on the decode engine: local 20 ms beats the split
    local = d.choose(1000, {"d": 800}, [busy], [p])
    assert local.prefill is None and local.ttft_s == pytest.approx(0.02)
    # prefill held at the gateway for the decode engine counts ahead of a local prompt
    d.speed.start(busy, 1000)  # 100 ms outstanding there, also ahead of a decode leg
    assert d.choose(1000, {"d": 800}, [busy], [p]).ttft_s == pytest.approx(0.12)
    assert d.choose(1000, {}, [busy], [p]).ttft_s == pytest.approx(0.15)


def test_pair_choice_prefers_the_shorter_prefill_queue_then_the_less_busy_decode():
    d = Disaggregator(DisaggregationConfig(policy="threshold", threshold_tokens=1))
    p1, p2 = eng("p1", "prefill"), eng("p2", "prefill")
    d1, d2 = eng("d1", "decode", in_flight=5), eng("d2", "decode", in_flight=1)
    d.speed.start(p1, 10_000)
    choice = d.choose(1000, {}, [d1, d2], [p1, p2])
    assert (choice.prefill.id, choice.decode.id) == ("p2", "d2")


def test_engine_roles_in_the_schema():
    assert EngineSpec(name="a", model="m", kind="external", url="http://x").role == "both"
    with pytest.raises(ValueError, match="needs kv_connector"):
        EngineSpec(name="a", model="m", kind="external", url="http://x", role="prefill")
    s = EngineSpec(name="a", model="m", kind="sim", role="decode", kv_connector="NixlConnector")
    assert (s.role, s.kv_connector) == ("decode", "NixlConnector")


def test_launch_commands_carry_the_role_and_connector():
    import json

    from engines.process import sim_command, vllm_command
    s = EngineSpec(name="a", model="m", kind="sim", role="prefill", kv_connector="NixlConnector")
    argv = sim_command(s, "127.0.0.1", 9000, None)
    assert argv[argv.index("--role") + 1] == "prefill"
    assert argv[argv.index("--kv-connector") + 1] == "NixlConnector"
    v = EngineSpec(name="b", model="m", model_path="/m", role="decode", kv_connector="NixlConnector")
    argv = vllm_command(v, "127.0.0.1", 9000, "/m")
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    plain = sim_command(EngineSpec(name="c", model="m", kind="sim"), "127.0.0.1", 9000, None)
    assert "--kv-connector" not in plain and "--role" not in plain


def test_a_busy_decode_engine_takes_local_prompts_that_fit_its_step_budget():
    cfg = DisaggregationConfig(max_decode_stall_ms=200, prefill_tokens_per_s=10_000)
    d = Disaggregator(cfg)
    p, busy = eng("p", "prefill"), eng("d", "decode", in_flight=1)
    d.speed.start(p, 50_000)  # the prefill engine is 5 s behind
    assert d.step_tokens(busy) == pytest.approx(2000)  # 200 ms at 100 µs per token
    assert d.step_tokens(p) is None  # a prefill engine is held by prefill_hold_tokens
    assert d.choose(2000, {}, [busy], [p]).prefill is None  # fits one step: local
    d.speed.start(busy, 1000)  # queued behind 100 ms of prefill there: still local
    assert d.choose(2000, {}, [busy], [p]).prefill is None
    assert d.choose(2001, {}, [busy], [p]).prefill is p  # one step too long: split
    # an idle decode engine stalls no stream: any prompt
    assert d.choose(20_000, {}, [eng("d2", "decode")], [p]).prefill is None


def test_the_step_budget_comes_from_a_trusted_latency_model():
    """Sarathi-Serve's token budget: ``(τ − b0 − b1 × (batch + 1)) / b2`` from the
    decode engine's fitted step time once the model is trusted; before, the TPOT
    target over the observed prefill speed."""
    from limits.engine_latency import EngineLatency
    from limits.latency_model import LatencyModel, LatencyPrior
    from limits.slo_gate import SloGate

    clock = ManualClock()
    prior = LatencyPrior(step_s=0.01, step_s_per_seq=0.001, step_s_per_prefill_token=5e-5)
    model = LatencyModel(prior, min_samples=5)
    busy = eng("d", "decode", in_flight=3)
    gate = SloGate(clock=clock)
    gate.ledgers["d"] = ledger = EngineLatency(model, clock)
    for _ in range(3):
        ledger.first_token(ledger.sent(0, 100, 0.1))
    d = Disaggregator(DisaggregationConfig(prefill_tokens_per_s=10_000), clock,
                      tpot_target_s=0.1, gate=gate)
    assert not model.confident
    assert d.step_tokens(busy) == pytest.approx(1000)  # 100 ms at 100 µs per token
    for _ in range(12):  # steps exactly as the prior says: trusted, parameters kept
        model.observe_tpot(0.01 + 0.001 * 4 + 5e-5 * 100, 4, 100, 50)
    assert model.confident
    # 3 decoding + this one: (0.1 − 0.01 − 0.004) / 5e-5 = 1,720 tokens
    assert d.step_tokens(busy) == pytest.approx(1720, rel=0.02)
    stalled = Disaggregator(DisaggregationConfig(max_decode_stall_ms=20), clock, gate=gate)
    assert stalled.step_tokens(busy) == pytest.approx(400, rel=0.02)  # 20 ms / 50 µs


def test_track_observes_the_first_token_time_on_the_injected_clock():
    clock = ManualClock(100.0)
    speed = PrefillSpeed(prior_s_per_token=1e-3, clock=clock)
    e = eng("d", "decode")
    with speed.track(e, 1000) as first_token:
        assert speed.outstanding["d"] == 1000
        clock.advance(0.5)
        first_token()  # 0.5 s for 1000 tokens
        assert speed.outstanding["d"] == 0
        first_token()  # once only
    assert speed.c(e) == pytest.approx(1e-3 + 0.2 * (5e-4 - 1e-3))
    with speed.track(e, 400):
        pass  # no first token: counted out, not observed
    assert speed.outstanding["d"] == 0 and speed.c(e) == pytest.approx(9e-4)


def split_placer(clock: ManualClock, decode_in_flight: int = 2):
    """A Placer over one prefill and one busy decode engine of a split model, with
    adaptive admission (its ledgers start at the prior: no learned limit yet)."""
    cfg = EnginesConfig.model_validate({"engines": [
        {"name": "p", "model": "m", "kind": "sim", "role": "prefill", "kv_connector": "X"},
        {"name": "d", "model": "m", "kind": "sim", "role": "decode", "kv_connector": "X"}]})
    p, d = eng("p", "prefill"), eng("d", "decode", in_flight=decode_in_flight)
    pool = EnginePool([p, d])
    for e in (p, d):
        pool.set_state(e, EngineState.READY)
        pool.set_metrics(e, MetricsSnapshot(at=clock.t, kv_cache_usage=0.1, block_size=16,
                                            num_blocks=100_000))
    disagg = Disaggregator(DisaggregationConfig(prefill_tokens_per_s=10_000), clock)
    placer = Placer(pool=pool, scheduler=Scheduler(cfg.scheduler),
                    detector=SaturationDetector.from_config(cfg), clock=clock, disagg=disagg,
                    split_models=frozenset({"m"}), adaptive=AdaptiveConfig())
    return placer, p, d


def test_a_split_request_predicted_to_start_past_its_ttft_budget_is_shed():
    clock = ManualClock()
    placer, p, d = split_placer(clock)
    need = Need(SchedRequest(model="m", tenant="t", prompt_tokens=3000), "interactive",
                tokens=3100, arrived=clock.t)
    speed = placer.disagg.speed
    speed.start(p, 20_000)  # 2 s of prefill queued at the prior 100 µs per token
    # the prior speed is a guess: served, not shed, however long the queue
    first = placer.place(need)
    assert first is not None and first.prefill is not None and first.prefill.engine is p
    first.release()
    # observed speeds (100 µs per token): 2.3 s predicted against the 1 s target
    speed.s_per_token.update(p=1e-4, d=1e-4)
    with pytest.raises(Rejected) as shed:
        placer.place(need)
    assert shed.value.outcome is Outcome.OVERLOADED and shed.value.reason == "predicted_miss"
    assert (p.in_flight, d.in_flight) == (0, 2)  # nothing leased
    # once the queue drains to 0.5 s, the same request is placed again
    speed.done(p, 15_000, 0, None)
    placed = placer.place(need)
    assert placed is not None and placed.prefill.engine is p
    assert placed.scores["pd_predicted_ttft_ms"] == pytest.approx(800.0)
    placed.release()
    # a request that waited 0.5 s in the gateway has 0.5 s left: 0.8 s misses it
    clock.advance(0.5)
    with pytest.raises(Rejected):
        placer.place(need)


def test_a_prompt_too_long_for_the_target_even_alone_is_served_at_best_effort():
    clock = ManualClock()
    placer, p, d = split_placer(clock)
    placer.disagg.speed.s_per_token.update(p=1e-4, d=1e-4)
    placer.disagg.speed.start(p, 5_000)
    # 20,000 tokens alone take 2 s of prefill, past the 1 s target with no queue
    need = Need(SchedRequest(model="m", tenant="t", prompt_tokens=20_000), "interactive",
                tokens=20_100, arrived=clock.t)
    placed = placer.place(need)
    assert placed is not None and placed.prefill is not None
    assert placed.scores["pd_predicted_ttft_ms"] == pytest.approx(2500.0)
    placed.release()
