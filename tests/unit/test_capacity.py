"""The capacity report from fitted latency models (limits.capacity)."""

from __future__ import annotations

import pytest

from limits.capacity import EngineView, Mix, MixTracker, band_capacity, desired_engines, report
from limits.latency_model import LatencyModel, LatencyPrior


def model(speed: float) -> LatencyModel:
    """A model whose parameters are the sim's cost structure at ``speed``, certain."""
    prior = LatencyPrior(ttft_overhead_s=0.066 / speed, prefill_s_per_token=0.00119 / speed,
                         ttft_s_per_seq=0.004 / speed, step_s=0.044 / speed,
                         step_s_per_seq=0.004 / speed, step_s_per_prefill_token=0.0,
                         rel_std=1e-6)
    return LatencyModel(prior)


MIX = Mix(prompt_tokens=1200, uncached_tokens=200, output_tokens=101)


def test_band_capacity_knee_kv_bound_and_littles_law() -> None:
    c = band_capacity(model(1.0), MIX, 1.0, 0.1, 0.0, block_size=128, num_blocks=433)
    assert c["knee"] == 14  # 44 + 4 b <= 100
    assert c["kv_blocks_per_request"] == 11  # ceil(1301 / 128)
    assert c["kv_bound"] == 39
    assert c["max_num_seqs"] == 14
    ttft = 0.066 + 0.00119 * 200 + 0.004 * 14
    rps = 14 / (ttft + (0.044 + 0.004 * 14) * 100)
    assert c["requests_per_s"] == pytest.approx(rps, rel=1e-3)
    # a small KV cache bounds the concurrency below the knee
    small = band_capacity(model(1.0), MIX, 1.0, 0.1, 0.0, block_size=128, num_blocks=60)
    assert small["kv_bound"] == 5 and small["max_num_seqs"] == 5
    # a prefill that misses the TTFT target even alone: no throughput within the SLO
    assert band_capacity(model(1.0), MIX, 0.1, 0.1, 0.0, 128, 433)["requests_per_s"] == 0
    # nor a decode that misses the TPOT target alone (48 ms at speed 1; 96 ms at 0.5)
    assert band_capacity(model(1.0), MIX, 1.0, 0.05, 0.0, 128, 433)["requests_per_s"] > 0
    assert band_capacity(model(0.5), MIX, 10.0, 0.09, 0.0, 128, 433)["requests_per_s"] == 0


def test_report_sizes_the_fleet_per_kind_and_prices_it() -> None:
    engines = [EngineView("fast-0", "fast", model(2.0), "model", 128, 433, 4.0),
               EngineView("slow-0", "slow", model(1.0), "model", 128, 433, None)]
    slo = {"interactive": (1.0, 0.1), "batch": (10.0, 0.2)}
    r = report(engines, MIX, slo, 0.0, target_rate=10.0)
    rows = {e["engine"]: e for e in r["engines"]}
    assert rows["fast-0"]["bands"]["interactive"]["knee"] > rows["slow-0"]["bands"]["interactive"]["knee"]
    assert rows["slow-0"]["bands"]["batch"]["knee"] > rows["slow-0"]["bands"]["interactive"]["knee"]
    fleet = r["fleet"]["by_kind"]
    assert r["fleet"]["band"] == "interactive"
    fast_rps = rows["fast-0"]["bands"]["interactive"]["requests_per_s"]
    assert fleet["fast"]["engines"] == -(-10.0 // fast_rps)
    assert fleet["fast"]["cost_per_hour"] == pytest.approx(4.0 * fleet["fast"]["engines"])
    assert fleet["slow"]["engines"] > fleet["fast"]["engines"]
    assert fleet["slow"]["cost_per_hour"] is None
    assert desired_engines(engines[:1], MIX, 1.0, 0.1, 0.0, rate=fast_rps * 3) == pytest.approx(3)


def test_mix_tracker_follows_the_requests() -> None:
    t = MixTracker(alpha=0.5)
    assert t.mix() is None
    t.observe(100, 50, 10)
    t.observe(300, 150, 30)
    assert t.mix() == Mix(200.0, 100.0, 20.0)
