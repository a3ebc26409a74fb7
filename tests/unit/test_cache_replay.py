"""Replaying a cached response as SSE and JSON; assembling a streamed answer."""

from __future__ import annotations

import json

from cache.assemble import StreamAssembler
from cache.replay import as_json, as_sse

CHAT = {
    "id": "chatcmpl-orig", "object": "chat.completion", "created": 1, "model": "served-name",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
}
COMPLETION = {
    "id": "cmpl-orig", "object": "text_completion", "created": 1, "model": "served-name",
    "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"},
                {"index": 1, "text": " there", "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
}


def parse_sse(frames: list[bytes]) -> tuple[list[dict], bool]:
    text = b"".join(frames).decode()
    assert text.endswith("\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    datas = [e[len("data: "):] for e in events]
    return [json.loads(d) for d in datas if d != "[DONE]"], datas[-1] == "[DONE]"


def reassemble(endpoint: str, frames: list[bytes]) -> dict:
    chunks, done = parse_sse(frames)
    asm = StreamAssembler(endpoint)
    for c in chunks:
        asm.feed(c)
    if done:
        asm.done()
    result = asm.result()
    assert result is not None
    return result


def test_chat_sse_replay_parses_back_to_the_same_answer_with_cached_usage():
    frames = list(as_sse(CHAT, "chat", "requested-name", include_usage=True))
    chunks, done = parse_sse(frames)
    assert done
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["model"] == "requested-name" and c["object"] == "chat.completion.chunk"
               for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != "chatcmpl-orig"
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == 12 and usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"]["cached_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])
    body = reassemble("chat", frames)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == usage


def test_chat_sse_without_usage_has_no_usage_chunk():
    chunks, done = parse_sse(list(as_sse(CHAT, "chat", "m")))
    assert done and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_sse_replay_keeps_every_choice():
    frames = list(as_sse(COMPLETION, "completions", "m", include_usage=True))
    body = reassemble("completions", frames)
    assert [c["text"] for c in body["choices"]] == [" world", " there"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


def test_json_replay_renames_model_and_marks_usage_without_touching_the_stored_dict():
    out = as_json(CHAT, "chat", "requested-name", clock=lambda: 1000.0)
    assert out["model"] == "requested-name" and out["created"] == 1000
    assert out["id"].startswith("chatcmpl-") and out["id"] != CHAT["id"]
    assert out["choices"] == CHAT["choices"]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
    assert "prompt_tokens_details" not in CHAT["usage"]


def test_a_streamed_answer_assembles_to_a_storable_body_and_replays_as_json():
    stream = [
        {"id": "c1", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"},
                                  "finish_reason": "stop"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                              "total_tokens": 6}},
    ]
    asm = StreamAssembler("chat")
    for c in stream:
        asm.feed(c)
    assert asm.result() is None  # no [DONE] yet: an aborted stream is never stored
    asm.done()
    body = asm.result()
    assert body == {"id": "c1", "created": 5, "model": "m", "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                        "content": "Hello"},
                                 "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    assert as_json(body, "chat", "m")["choices"] == body["choices"]


def test_truncated_or_failed_streams_do_not_assemble():
    cut = StreamAssembler("chat")
    cut.feed({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    cut.done()
    assert cut.result() is None  # no finish_reason
    failed = StreamAssembler("completions")
    failed.feed({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})
    failed.feed({"error": {"message": "engine died"}})
    failed.done()
    assert failed.result() is None
