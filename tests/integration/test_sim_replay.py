"""Replay smoke against one simulated engine on loopback (in-process)."""

from __future__ import annotations

from loadtest.replay import Replayer
from loadtest.report import EngineStats, Slo, plot, summarize
from loadtest.sim_engine import SimEngine, get_profile, serve
from loadtest.workloads import WorkloadOptions, build_workload


async def test_replay_mixed_tenants_smoke(tmp_path):
    engine = SimEngine(get_profile("cpu-gemma3-270m-quiet").with_overrides(max_model_len=4096,
                                                                     num_blocks=200),
                       "sim-model", speed=20.0)
    runner = await serve(engine, "127.0.0.1", 0)
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    try:
        wl = build_workload("mixed-tenants", WorkloadOptions(limit=30, rate=20.0,
                                                             max_output_tokens=8))
        engines = [EngineStats(url)]
        results, wall = await Replayer(url, {}, duration_s=60).run(wl.requests, engines, 0.2)
    finally:
        await runner.cleanup()
    assert len(results) == 30 and all(r.status == 200 for r in results)
    assert all(r.completion_tokens == 8 and r.ttft_ms is not None for r in results)
    s = summarize(results, engines, Slo(), wall)
    assert s["ok"] == 30 and s["ttft_ms"]["p50"] > 0
    assert s["prefix_hit_rate"] > 0.3  # each tenant's system prompt is shared
    assert engines[0].samples
    assert {p.name for p in plot(results, engines, tmp_path)} == {"latency_cdf.png",
                                                                  "engine_load.png"}
