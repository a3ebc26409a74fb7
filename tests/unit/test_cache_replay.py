"""Replaying a cached response as SSE and as JSON."""

from __future__ import annotations

import json

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
    """Rebuild choices and usage from replayed frames, as a streaming client would."""
    chunks, done = parse_sse(frames)
    assert done
    choices: dict[int, dict] = {}
    usage = None
    for c in chunks:
        usage = c.get("usage") or usage
        for part in c["choices"]:
            choice = choices.setdefault(part["index"], {"text": "", "finish_reason": None})
            choice["text"] += (part["delta"].get("content") or "") if endpoint == "chat" \
                else part["text"]
            choice["finish_reason"] = part["finish_reason"] or choice["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


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
    assert body["choices"] == [{"text": "Paris.", "finish_reason": "stop"}]
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
