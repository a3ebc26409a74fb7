"""Parsing a client's body (``gateway/openai_api.py``): the output cap, the
sequence count, the parameter named in a 400, hostile JSON."""

from __future__ import annotations

import pytest

from gateway.openai_api import output_cap, parse_json, parse_request
from limits.outcome import Outcome, Rejected


def test_parse_request_output_fields():
    r = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": 50, "max_tokens": 70})
    assert r.max_output_tokens == 50 and r.output_field == "max_completion_tokens"
    r.set_output_cap(10)
    assert r.body["max_completion_tokens"] == 10 and "max_tokens" not in r.body
    r = parse_request("completions", {"model": "m", "prompt": [[1, 2, 3], [4]]})
    assert r.prompt_tokens == 4 and r.max_output_tokens is None and r.output_field == "max_tokens"


@pytest.mark.parametrize("endpoint,fields,field,cap", [
    # chat: max_completion_tokens wins when set (vLLM ChatCompletionRequest)
    ("chat", {"max_completion_tokens": 50, "max_tokens": 70}, "max_completion_tokens", 50),
    ("chat", {"max_completion_tokens": None, "max_tokens": 100}, "max_tokens", 100),
    ("chat", {"max_tokens": 100}, "max_tokens", 100),
    ("chat", {}, "max_tokens", None),
    # completions: vLLM reads max_tokens only
    ("completions", {"max_tokens": 3000, "max_completion_tokens": 1}, "max_tokens", 3000),
    ("completions", {"max_completion_tokens": 5}, "max_tokens", None),
    ("completions", {"max_tokens": None, "max_completion_tokens": 5}, "max_tokens", None),
])
def test_output_cap_is_the_field_the_engine_reads(endpoint, fields, field, cap):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    r = parse_request(endpoint, {"model": "m", **base, **fields})
    assert (r.output_field, r.max_output_tokens) == (field, cap)
    assert output_cap(endpoint, r.body) == (field, cap)


@pytest.mark.parametrize("endpoint,fields,n", [
    ("chat", {}, 1), ("chat", {"n": 10}, 10), ("completions", {"n": 2, "best_of": 5}, 5),
    ("completions", {"prompt": ["a"] * 8}, 8), ("completions", {"prompt": ["a"] * 8, "n": 3}, 24),
    ("completions", {"prompt": [[1, 2], [3]], "n": 2}, 4), ("completions", {"prompt": [1, 2]}, 1),
])
def test_sequences_count_every_generated_output(endpoint, fields, n):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    assert parse_request(endpoint, {"model": "m", **base, **fields}).sequences == n


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_parse_request_names_the_param(body, param):
    with pytest.raises(Rejected) as e:
        parse_request("chat", body)
    assert e.value.outcome is Outcome.INVALID_REQUEST and e.value.param == param


@pytest.mark.parametrize("raw,fragment", [
    (b'{"model": "m", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
])
def test_hostile_json_is_a_400(raw, fragment):
    with pytest.raises(Rejected) as e:
        parse_json(raw)
    assert e.value.outcome is Outcome.INVALID_REQUEST and fragment in e.value.message


def test_paired_surrogate_escapes_are_characters():
    assert parse_json(b'{"c": "\\ud83d\\ude80"}') == {"c": "\U0001F680"}


def test_non_string_content_part_text_is_ignored_by_the_estimate():
    r = parse_request("chat", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}]})
    assert r.prompt_text == "hi"
