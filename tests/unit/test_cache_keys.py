"""Cache keys, cacheability policy and semantic guards (pure logic)."""

from __future__ import annotations

import pytest

from cache.guards import compatible, features
from cache.keys import EXCLUDED_FIELDS, make_key
from cache.policy import request_cacheable, response_storable
from config.schema import TenantCache

BASE = {
    "model": "m",
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
}


def key(body=BASE, ns="tenant:a", model="m", endpoint="chat"):
    return make_key(ns, endpoint, model, body)


@pytest.mark.parametrize("field,value", [
    ("temperature", 0.5), ("top_p", 0.9), ("max_tokens", 10), ("max_completion_tokens", 10),
    ("n", 2), ("stop", ["\n"]), ("seed", 7), ("tools", [{"type": "function",
                                                         "function": {"name": "f"}}]),
    ("tool_choice", "none"), ("response_format", {"type": "json_object"}),
    ("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("logit_bias", {"50256": -100}),
    ("some_unknown_engine_field", 1),
])
def test_every_output_parameter_changes_the_exact_key(field, value):
    assert key({**BASE, field: value}).exact != key().exact


def test_model_tenant_endpoint_and_system_prompt_change_the_key():
    other_system = {**BASE, "messages": [{"role": "system", "content": "Be verbose."},
                                         BASE["messages"][1]]}
    keys = {key().exact, key(model="other").exact, key(ns="tenant:b").exact,
            key(endpoint="completions").exact, key(other_system).exact}
    assert len(keys) == 5
    assert key(other_system).scope != key().scope
    assert key(ns="tenant:b").scope != key().scope
    assert key(model="other").scope != key().scope


def test_omitted_temperature_is_one_not_zero():
    no_temp = {k: v for k, v in BASE.items() if k != "temperature"}
    assert key(no_temp).exact != key().exact
    assert key(no_temp).exact == key({**BASE, "temperature": 1}).exact
    assert key({**BASE, "temperature": 0.0}).exact == key().exact  # 0 and 0.0 agree


def test_transport_fields_do_not_change_the_key():
    assert "stream" in EXCLUDED_FIELDS and "user" in EXCLUDED_FIELDS
    noisy = {**BASE, "stream": True, "stream_options": {"include_usage": True},
             "user": "u1", "metadata": {"x": 1}}
    assert key(noisy) == key()


def test_defaults_and_stop_forms_are_normalised():
    assert key({**BASE, "top_p": 1, "n": 1}).exact == key().exact
    assert key({**BASE, "stop": "x"}).exact == key({**BASE, "stop": ["x"]}).exact


def test_scope_excludes_only_the_last_user_turn():
    other_q = {**BASE, "messages": [BASE["messages"][0],
                                    {"role": "user", "content": "Capital of Spain?"}]}
    assert key(other_q).scope == key().scope and key(other_q).exact != key().exact
    assert key().query == "What is the capital of France?"
    assert key({**BASE, "temperature": 0.3}).scope != key().scope
    longer = {**BASE, "messages": [*BASE["messages"], {"role": "assistant", "content": "Paris"},
                                   {"role": "user", "content": "And Spain?"}]}
    assert key(longer).scope != key().scope


def test_no_semantic_form_for_completions_or_non_text_last_turn():
    assert key({"prompt": "Hello", "temperature": 0}, endpoint="completions").scope is None
    image = {**BASE, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    assert key(image).scope is None
    parts = {**BASE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert key(parts).query == "a\nb"


def test_policy_deterministic_only_unless_opted_in():
    on, sampled = TenantCache(), TenantCache(cache_sampled=True)
    assert request_cacheable({"temperature": 0}, on)
    assert request_cacheable({"seed": 1, "temperature": 0.8}, on)
    assert not request_cacheable({}, on)  # omitted temperature = 1
    assert not request_cacheable({"temperature": 0.7}, on)
    assert request_cacheable({"temperature": 0.7}, sampled)
    assert not request_cacheable({"temperature": 0}, TenantCache(enabled=False))


def test_only_complete_answers_are_storable():
    ok = {"choices": [{"index": 0, "finish_reason": "stop"},
                      {"index": 1, "finish_reason": "length"}]}
    assert response_storable(ok)
    assert not response_storable({"error": {"message": "boom"}})
    assert not response_storable({"choices": []})
    assert not response_storable({"choices": [{"finish_reason": None}]})
    assert not response_storable({"choices": [{"finish_reason": "abort"}]})
    assert not response_storable({"choices": [{"finish_reason": "tool_calls"}]})
    assert not response_storable({"choices": [{"finish_reason": "stop"},
                                              {"finish_reason": "content_filter"}]})


@pytest.mark.parametrize("a,b", [
    ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?"),
    ("Is coffee good for you?", "Is coffee not good for you?"),
    ("Why can't I sleep at night?", "Why can I sleep at night?"),
    ("What is 15% of 200?", "What is 15% of 300?"),
    ("Best laptop under 1,000 dollars?", "Best laptop under 2000 dollars?"),
    ("Top three movies of 2019?", "Top five movies of 2019?"),
    ("What is the capital of France?", "What is the capital of Spain?"),
    ("How do I increase the volume?", "How do I decrease the volume?"),
])
def test_guards_separate_different_questions(a, b):
    assert not compatible(features(a), features(b))
    assert not compatible(features(b), features(a))


@pytest.mark.parametrize("a,b", [
    ("How do I learn Python fast?", "What is the quickest way to learn python?"),
    ("How do I enable dark mode?", "How can I turn on dark mode? How do I enable it?"),
    ("What is 2 + 2?", "what's 2+2"),
    ("Where is Paris?", "Where is paris located?"),
])
def test_guards_let_paraphrases_through(a, b):
    assert compatible(features(a), features(b))
