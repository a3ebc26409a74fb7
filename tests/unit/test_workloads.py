"""Workload loaders on the real shared files (../shared/data)."""

from __future__ import annotations

import pytest

from engines.blocks import chain_block_hashes, fallback_tokenize
from loadtest.sim_engine.protocol import render_chat
from loadtest.workloads import (
    WORKLOADS,
    WorkloadOptions,
    build_workload,
    data_dir,
    ideal_hit_rate,
    read_trace,
)
from loadtest.workloads.base import text_block
from loadtest.workloads.mooncake import prompt_text

pytestmark = pytest.mark.skipif(not (data_dir() / "mooncake").is_dir(),
                                reason="shared data not present")


def test_mooncake_counts_and_ideal_hit_rate():
    records = read_trace()
    assert len(records) == 12_031
    assert ideal_hit_rate(records) == pytest.approx(0.374, abs=0.005)


def test_same_hash_id_same_text_and_shared_prefix_blocks():
    assert text_block("mooncake/7") == text_block("mooncake/7")
    assert len(fallback_tokenize(text_block("mooncake/7"))) == 512
    a = prompt_text([0, 1, 2], 1400)
    b = prompt_text([0, 1, 9], 1300)
    assert len(fallback_tokenize(a)) == 1400 and len(fallback_tokenize(b)) == 1300
    assert a[: len(text_block("mooncake/0") + text_block("mooncake/1"))] == \
        b[: len(text_block("mooncake/0") + text_block("mooncake/1"))]
    # After the chat template, the shared 1024 tokens give shared engine blocks.
    ha = chain_block_hashes(fallback_tokenize(render_chat([{"role": "user", "content": a}])), 128)
    hb = chain_block_hashes(fallback_tokenize(render_chat([{"role": "user", "content": b}])), 128)
    shared = sum(1 for x, y in zip(ha, hb, strict=False) if x == y)
    assert shared == 8  # (1024 + template head) // 128


def test_mooncake_workload_bounds_and_scaling():
    opts = WorkloadOptions(duration_s=30, time_scale=0.5, max_input_tokens=2000,
                           max_output_tokens=64, model="m")
    w = build_workload("mooncake-conversation", opts)
    records = read_trace()
    expected = sum(1 for r in records if r["timestamp"] / 1000 * 0.5 < 30)
    assert len(w.requests) == expected
    assert all(a.at_s <= b.at_s for a, b in zip(w.requests, w.requests[1:], strict=False))
    r0 = w.requests[0]
    assert r0.body["model"] == "m" and r0.body["max_tokens"] <= 64
    assert len(fallback_tokenize(r0.body["messages"][0]["content"])) <= 2000
    assert len(build_workload("mooncake-conversation", WorkloadOptions(limit=7)).requests) == 7


def test_mooncake_path_form(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}\n')
    w = build_workload(str(f), WorkloadOptions())
    assert [r.at_s for r in w.requests] == [0.0, 0.5]
    assert [r.body["max_tokens"] for r in w.requests] == [5, 3]
    assert ideal_hit_rate(read_trace(f)) == pytest.approx(512 / 1300)


@pytest.mark.parametrize("kind,rows,rate", [("code", 8_819, 2.57), ("conv", 19_366, 5.53)])
def test_azure(kind, rows, rate):
    every = build_workload(f"azure-{kind}", WorkloadOptions(max_input_tokens=1))
    assert len(every.requests) == rows
    assert rows / every.duration_s == pytest.approx(rate, rel=0.03)
    w = build_workload(f"azure-{kind}", WorkloadOptions(duration_s=60, max_input_tokens=300))
    assert all(r.at_s < 60 for r in w.requests) and len(w.requests) > 20
    full = build_workload(f"azure-{kind}", WorkloadOptions(limit=3))
    assert len(full.requests) == 3 and full.requests[0].at_s == 0.0
    texts = [r.body["messages"][0]["content"] for r in w.requests[:5]]
    assert len(set(texts)) == 5 and all(len(fallback_tokenize(t)) <= 300 for t in texts)


def test_arena_poisson_rate_and_real_text():
    w = build_workload("arena-hard", WorkloadOptions(limit=400, rate=4.0, seed=1))
    assert len(w.requests) == 400
    assert 400 / w.duration_s == pytest.approx(4.0, rel=0.15)
    assert w == build_workload("arena-hard", WorkloadOptions(limit=400, rate=4.0, seed=1))
    assert len(build_workload("arena-hard-v2", WorkloadOptions(limit=5)).requests) == 5


def test_scenarios_and_registry():
    for name in WORKLOADS:
        w = build_workload(name, WorkloadOptions(limit=20, max_input_tokens=1500))
        assert 0 < len(w.requests) <= 20, name
    mixed = build_workload("mixed-tenants", WorkloadOptions(limit=200))
    assert {r.tenant for r in mixed.requests} == {"acme", "globex", "initech"}
    for r in mixed.requests:
        assert (r.tenant, r.priority, r.api_key_slot) in {
            ("acme", "interactive", 0), ("globex", "standard", 1), ("initech", "batch", 2)}
    burst = build_workload("high-concurrency", WorkloadOptions())
    assert len(burst.requests) == 256 and burst.duration_s < 1.0
    with pytest.raises(KeyError):
        build_workload("nope", WorkloadOptions())
