"""What an operator sees (issue 41): the dashboard's headline, the capacity report of
a best-effort engine, and ``sluice capacity`` in words with the engine's real kind."""

from __future__ import annotations

import config.schema  # noqa: F401 - first: engines.interfaces alone hits an import cycle
from engines.pool import Engine
from gateway.capacity import engine_kind
from gateway.cli import capacity_text
from gateway.stats import headline
from limits.capacity import EngineView, Mix, report
from tests.unit.test_engine_protection import slow_engine_model


def test_headline_reads_overload_not_a_tenants_quota() -> None:
    idle = [(0, 14)]
    assert headline(0.0, 0, [1.0] * 20, idle, 1.0) == "OK"
    # shedding for overload (the feed's shed_rps counts overload reasons only)
    assert headline(3.0, 0, [1.0] * 20, idle, 1.0) == "REJECTING"
    assert headline(0.0, 5, [1.0] * 20, idle, 1.0) == "QUEUEING"
    # the 500-client flood: 500 in flight, nothing finished for 10 s, no limit known
    assert headline(0.0, 0, [0.0] * 20, [(500, None)], 1.0) == "STALLED"
    # nothing in flight and nothing admitted is idle, not stalled
    assert headline(0.0, 0, [0.0] * 20, [(0, None)], 1.0) == "OK"
    # fewer readings than the stall window: not yet a stall
    assert headline(0.0, 0, [0.0] * 3, [(500, None)], 1.0) == "OK"
    # an engine at its limit, requests still finishing
    assert headline(0.0, 0, [1.0] * 20, [(14, 14), (2, None)], 1.0) == "SATURATED"


MIX = Mix(prompt_tokens=60.0, uncached_tokens=60.0, output_tokens=32.0)


def test_capacity_of_a_best_effort_engine_in_words() -> None:
    view = EngineView("gemma-0", "gemma-0", slow_engine_model(), "best_effort", 128, 432,
                      None, "vllm", 55_296)
    rep = report([view], MIX, {"interactive": (1.0, 0.1)}, 2.0, target_rate=1.0)
    row = rep["engines"][0]
    assert (row["kind"], row["spec"], row["kv_capacity_tokens"]) == ("vllm", "gemma-0", 55_296)
    band = row["bands"]["interactive"]
    assert band["within_slo"] is False and band["requests_per_s"] == 0.0
    assert band["throughput_knee"] == 50 and band["best_effort_requests_per_s"] > 0
    text = capacity_text({"model": "gemma3-270m", **rep})
    assert "engine gemma-0 (vllm engine, spec gemma-0; KV cache 55,296 tokens; " \
           "admission: best effort)" in text
    assert "interactive: cannot meet the SLO even with one request; at best effort" in text
    assert "up to 50 in flight (throughput knee)" in text
    assert "no number of gemma-0 (vllm engine) meets it" in text
    assert "None" not in text and "0.00 req" not in text
    assert capacity_text({"model": "m", "mix": None, "engines": []}) == \
        "model m: no request finished yet, nothing measured"


def test_engine_kind_is_the_serving_engine_not_its_name() -> None:
    launched = Engine("gemma-0", "m", "http://x", labels={"spec": "gemma-0", "kind": "vllm",
                                                          "dialect": "vllm"})
    external = Engine("e0", "m", "http://x", labels={"spec": "e0", "kind": "external",
                                                     "dialect": "llamacpp"})
    assert (engine_kind(launched), engine_kind(external)) == ("vllm", "llamacpp")
