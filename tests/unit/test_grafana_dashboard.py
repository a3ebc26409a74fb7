"""``config/grafana/sluice-dashboard.json``: valid Grafana dashboard JSON whose queries
use only Sluice's Prometheus metric names (with their own labels), whose panels cover
the sections of ``/dashboard``, and whose layout has no overlapping panels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "config" / "grafana" / "sluice-dashboard.json"

#: The metrics the gateway exports (gateway/metrics.py) and their labels.
METRICS: dict[str, set[str]] = {
    "sluice_requests_total": {"tenant", "model", "endpoint", "outcome", "status"},
    "sluice_request_duration_seconds_bucket": {"model", "engine", "le"},
    "sluice_ttft_seconds_bucket": {"model", "engine", "le"},
    "sluice_tpot_seconds_bucket": {"model", "engine", "le"},
    "sluice_queue_depth": {"model", "priority"},
    "sluice_queue_wait_seconds_bucket": {"model", "priority", "le"},
    "sluice_rejected_total": {"tenant", "reason"},
    "sluice_degraded_total": {"model", "action"},
    "sluice_tokens_total": {"tenant", "model", "endpoint", "kind"},
    "sluice_cached_tokens_total": {"tenant", "model", "endpoint", "kind"},
    "sluice_cache_lookups_total": {"kind", "result"},
    "sluice_engine_up": {"engine", "model", "state"},
    "sluice_engine_kv_cache_usage_ratio": {"engine", "model"},
    "sluice_engine_requests_running": {"engine", "model"},
    "sluice_engine_requests_waiting": {"engine", "model"},
    "sluice_engine_restarts_total": {"engine", "model"},
    "sluice_engine_breaker_open": {"engine", "model"},
    "sluice_engine_prefix_match_ratio": {"engine", "model"},
    "sluice_config_reloads_total": {"result"},
    "sluice_engine_concurrency_limit": {"engine", "model"},
    "sluice_engine_requests_in_flight": {"engine", "model"},
    "sluice_predicted_ttft_error_bucket": {"model", "engine", "le"},
}
#: PromQL functions, aggregations and keywords the queries may use.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "topk", "bottomk", "rate", "irate", "increase",
    "histogram_quantile", "vector", "clamp_min", "clamp_max", "label_values", "by", "without",
    "on", "ignoring", "group_left", "group_right", "or", "and", "unless", "bool", "offset",
}
#: Every section of /dashboard, as words some panel title must contain.
SECTIONS = [
    ("queue depth", "priority"), ("admitted", "tenant"), ("rejected", "reason"),
    ("kv cache", "engine"), ("running", "waiting"), ("engine state",), ("ttft", "p50"),
    ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"), ("cache hit rate",), ("reload",),
]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(PATH.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(d: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(d) for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    return exprs


def metric_names(expr: str) -> tuple[set[str], list[tuple[str, set[str]]]]:
    """Metric names in a PromQL expression, and the label names each selector uses."""
    selectors = [(m.group(1), {lab.strip() for lab in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)",
                                                                  m.group(2))})
                 for m in re.finditer(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr)]
    expr = re.sub(r"label_values\(\s*([^,()]+?)\s*,\s*\w+\s*\)", r"\1", expr)  # Grafana variable
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)      # strings
    bare = re.sub(r"\{[^}]*\}", "", bare)                # label matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)               # range selectors
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    words = set(re.findall(r"(?<![\w$.])[A-Za-z_:][\w:]*", bare))
    return words - PROMQL_WORDS, selectors


def test_metric_name_extraction() -> None:
    names, sel = metric_names('histogram_quantile(0.99, sum by (le) (rate(foo_seconds_bucket'
                              '{model=~"$model"}[$__rate_interval]))) / on (x) bar or vector(0)')
    assert names == {"foo_seconds_bucket", "bar"} and sel == [("foo_seconds_bucket", {"model"})]
    assert metric_names("label_values(sluice_queue_depth, model)")[0] == {"sluice_queue_depth"}


def test_valid_grafana_dashboard(dashboard: dict) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names[0] == "datasource"
    for p in panels(dashboard):
        assert {"type", "title", "gridPos"} <= set(p)
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]


def test_layout_does_not_overlap(dashboard: dict) -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in panels(dashboard):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_queries_use_only_sluice_metrics(dashboard: dict) -> None:
    used: set[str] = set()
    for expr in queries(dashboard):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names, selectors = metric_names(expr)
        assert names <= set(METRICS), f"unknown metric in {expr!r}: {names - set(METRICS)}"
        assert names, f"no metric in {expr!r}"
        for metric, labels in selectors:
            assert metric in METRICS, expr
            assert labels <= METRICS[metric], f"{metric} has no label {labels - METRICS[metric]}"
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            grouped = {g.strip() for g in group.split(",") if g.strip()}
            assert any(grouped <= METRICS[n] for n in names), f"{grouped} in {expr!r}"
        used |= names
    # every exported series is on some panel
    assert used == set(METRICS), set(METRICS) - used


def test_panels_cover_the_dashboard_sections(dashboard: dict) -> None:
    titles = [p["title"].lower() for p in panels(dashboard)]
    for words in SECTIONS:
        assert any(all(w in t for w in words) for t in titles), words
