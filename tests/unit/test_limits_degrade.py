"""The degradation ladder decides (rungs, shed); the gateway applies a rung on the
output-length field the engine reads (``InferenceRequest.apply``)."""

from __future__ import annotations

from typing import Any

from config.schema import DegradationConfig
from gateway.openai_api import InferenceRequest, parse_request
from limits.degrade import Rung, ladder, shed
from limits.outcome import Outcome

FULL = DegradationConfig(max_tokens_cap=256, fallback_model="small")
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> InferenceRequest:
    return parse_request("chat", {"model": "big", "messages": MESSAGES, **fields})


def test_ladder_lists_the_configured_rungs_in_order() -> None:
    assert ladder(FULL, "batch") == (Rung(cap_output=256), Rung(fallback_model="small"))
    assert ladder(DegradationConfig(fallback_model="small"), "standard") == (
        Rung(fallback_model="small"),)
    assert ladder(DegradationConfig(), "batch") == ()


def test_priorities_not_sheddable_get_no_rungs() -> None:
    assert ladder(FULL, "interactive") == ()


def test_shed_is_overloaded_with_retry_after() -> None:
    e = shed("big", "batch", 4.0)
    assert e.outcome is Outcome.OVERLOADED and e.reason == "shed" and e.retry_after_s == 4.0
    assert "big" in e.message and "batch" in e.message


def test_cap_lowers_a_larger_cap_on_the_field_the_engine_reads() -> None:
    r = chat(max_tokens=1000)
    assert r.apply(Rung(cap_output=256)) == "max_tokens=256"
    assert r.body["max_tokens"] == 256 and "max_completion_tokens" not in r.body


def test_cap_on_chat_goes_on_max_completion_tokens_and_drops_max_tokens() -> None:
    r = chat(max_completion_tokens=900, max_tokens=5000)
    assert r.apply(Rung(cap_output=256)) == "max_completion_tokens=256"
    assert r.body["max_completion_tokens"] == 256 and "max_tokens" not in r.body


def test_cap_on_completions_goes_on_max_tokens_which_vllm_reads() -> None:
    r = parse_request("completions", {"model": "big", "prompt": "x", "max_tokens": 3000,
                                      "max_completion_tokens": 1})
    assert r.max_output_tokens == 3000
    assert r.apply(Rung(cap_output=256)) == "max_tokens=256"
    assert r.body["max_tokens"] == 256 and r.max_output_tokens == 256


def test_cap_sets_a_missing_cap_and_keeps_a_lower_one() -> None:
    r = chat()
    assert r.apply(Rung(cap_output=256)) == "max_tokens=256" and r.max_output_tokens == 256
    low = chat(max_tokens=100)
    assert low.apply(Rung(cap_output=256)) is None and low.body["max_tokens"] == 100


def test_fallback_routes_to_the_other_model_once() -> None:
    r = chat(max_tokens=10)
    assert r.apply(Rung(fallback_model="small")) == "model=small"
    assert r.model == "small" and r.body["model"] == "small"
    assert r.apply(Rung(fallback_model="small")) is None
