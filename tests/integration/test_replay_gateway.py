"""Replay smoke through the gateway: `python -m loadtest replay --engines 2` starts
`sluice serve` with two simulated engines and replays a short workload through it."""

from __future__ import annotations

import json

from loadtest.replay import main as replay


def test_replay_through_the_gateway_to_two_simulated_engines(tmp_path):
    report, lines = tmp_path / "out" / "report.json", tmp_path / "out" / "requests.jsonl"
    rc = replay(["--workload", "mixed-tenants", "--engines", "2", "--policy", "default",
                 "--limit", "30", "--rate", "20", "--max-output-tokens", "8",
                 "--duration", "30", "--drain", "20", "--json", str(report),
                 "--out", str(lines), "--plots", str(tmp_path / "plots")])
    assert rc == 0
    summary = json.loads(report.read_text())
    assert summary["requests"] == 30 and summary["ok"] == 30
    assert sorted(summary["requests_per_engine"]) == ["sim-0", "sim-1"]
    assert sum(summary["requests_per_engine"].values()) == 30
    assert summary["prefix_hit_rate"] > 0.3  # tenants' system prompts are reused
    # what the benchmark's config changes from the shipped one is printed with the reason
    assert summary["setup"]["changed"]["engines.saturation.max_waiting"]["value"] == 100_000
    assert summary["setup"]["changed"]["gateway.cache.enabled"]["why"]
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(rows) == 30 and all(r["status"] == 200 and r["engine"] for r in rows)
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"latency_cdf.png",
                                                                "engine_load.png"}


def test_replay_through_two_gateway_replicas_on_one_redis(tmp_path):
    """``--gateways 2``: the engines are launched by the benchmark and listed as
    ``external`` (with KV events) in two ``sluice serve`` replicas; requests alternate
    between them; the report sets the hit rate beside one gateway's."""
    report = tmp_path / "out" / "report.json"
    rc = replay(["--workload", "mixed-tenants", "--engines", "2", "--policy", "default",
                 "--gateways", "2", "--limit", "30", "--rate", "20",
                 "--max-output-tokens", "8", "--duration", "30", "--drain", "20",
                 "--json", str(report), "--config-out", str(tmp_path / "cfg")])
    assert rc == 0
    summary = json.loads(report.read_text())
    assert summary["gateways"] == 2 and summary["requests"] == 30 and summary["ok"] == 30
    assert sorted(summary["requests_per_engine"]) == ["sim-0", "sim-1"]
    assert summary["prefix_hit_rate"] > 0.3 and summary["one_gateway"]["prefix_hit_rate"] > 0.3
    assert summary["prefix_hit_rate_vs_one_gateway"] == round(
        summary["prefix_hit_rate"] / summary["one_gateway"]["prefix_hit_rate"], 4)
    engines = (tmp_path / "cfg" / "gateways-2" / "engines.yaml").read_text()
    assert engines.count("kind: external") == 2 and engines.count("kv_events:") == 2
    assert summary["setup"]["changed"]["gateway.limits.store_url"]["value"].startswith("redis://")
