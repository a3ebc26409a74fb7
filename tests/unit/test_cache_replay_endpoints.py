"""The response cache for OpenAI Responses and Anthropic Messages (issue 42): which
answers are stored, how a hit is rendered as JSON and as the endpoint's own events, and
that the gateway's stream summaries rebuild exactly the body the replay started from."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from cache.policy import cut_at_cap, response_storable
from cache.replay import as_json, as_sse
from gateway.endpoints import MessagesSummary, ResponsesSummary

MESSAGE_ITEM = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Paris is the capital.",
                             "annotations": []}]}
RESPONSE = {"id": "resp_orig", "object": "response", "created_at": 5, "model": "served",
            "status": "completed", "error": None, "output": [MESSAGE_ITEM],
            "usage": {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 16}}
MESSAGE = {"id": "msg_orig", "type": "message", "role": "assistant", "model": "served",
           "content": [{"type": "text", "text": "Paris"}, {"type": "text", "text": " it is."}],
           "stop_reason": "end_turn", "stop_sequence": None,
           "usage": {"input_tokens": 9, "output_tokens": 4}}


def events_of(frames: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each frame; every frame has both lines and they agree."""
    out = []
    for frame in b"".join(frames).decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        out.append((data["type"], data))
    return out


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(base), **changes}


@pytest.mark.parametrize(("answer", "stored"), [
    (RESPONSE, True),
    (with_(RESPONSE, status="incomplete"), False),
    (with_(RESPONSE, status="incomplete",
           incomplete_details={"reason": "max_output_tokens"}), True),
    (with_(RESPONSE, status="incomplete",
           incomplete_details={"reason": "content_filter"}), False),
    (with_(RESPONSE, error={"code": "server_error", "message": "x"}), False),
    (with_(RESPONSE, output=[]), False),
    (with_(RESPONSE, output=[{"id": "fc_1", "type": "function_call", "name": "f",
                              "arguments": "{}", "call_id": "c"}]), False),
    (with_(RESPONSE, output=[{"id": "rs_1", "type": "reasoning",
                              "content": [{"type": "reasoning_text", "text": "hm"}]},
                             MESSAGE_ITEM]), False),
    (MESSAGE, True),
    (with_(MESSAGE, stop_reason="max_tokens"), True),
    (with_(MESSAGE, stop_reason="tool_use"), False),
    (with_(MESSAGE, content=[{"type": "text", "text": "x"},
                             {"type": "tool_use", "id": "t", "name": "f", "input": {}}]), False),
    (with_(MESSAGE, content=[{"type": "thinking", "thinking": "hm", "signature": ""}]), False),
    (with_(MESSAGE, content=[]), False),
])
def test_only_complete_text_answers_are_stored(answer, stored):
    assert response_storable(answer) is stored


def test_cut_at_cap_per_endpoint():
    assert cut_at_cap(with_(MESSAGE, stop_reason="max_tokens"))
    assert not cut_at_cap(MESSAGE)
    assert cut_at_cap(with_(RESPONSE, status="incomplete",
                            incomplete_details={"reason": "max_output_tokens"}))
    assert not cut_at_cap(RESPONSE)
    assert cut_at_cap({"choices": [{"finish_reason": "length"}]})


def test_response_replay_is_a_new_response_with_cached_input():
    out = as_json(RESPONSE, "responses", "asked-name", clock=lambda: 1000.0)
    assert out["id"].startswith("resp_") and out["id"] != RESPONSE["id"]
    assert (out["created_at"], out["model"]) == (1000, "asked-name")
    assert out["usage"]["input_tokens"] == 11 and out["usage"]["output_tokens"] == 5
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": 11}
    assert out["output"] == RESPONSE["output"] and RESPONSE["id"] == "resp_orig"


def test_response_stream_replay_is_the_responses_event_sequence():
    events = events_of(list(as_sse(RESPONSE, "responses", "asked-name")))
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[0][1]["response"]["output"] == []
    assert events[4][1]["delta"] == "Paris is the capital."
    assert events[4][1]["item_id"] == "msg_1"
    final = events[-1][1]["response"]
    assert final["id"] == events[0][1]["response"]["id"] != "resp_orig"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 11


def test_message_replay_moves_the_input_to_cache_reads():
    out = as_json(MESSAGE, "messages", "asked-name")
    assert out["id"].startswith("msg_") and out["id"] != "msg_orig"
    assert out["model"] == "asked-name" and out["content"] == MESSAGE["content"]
    assert out["usage"] == {"input_tokens": 0, "cache_read_input_tokens": 9,
                            "output_tokens": 4}


def test_message_stream_replay_is_anthropics_event_sequence():
    events = events_of(list(as_sse(MESSAGE, "messages", "asked-name")))
    assert [n for n, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == [
        "Paris", " it is."]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


@pytest.mark.parametrize(("endpoint", "answer", "summary_type"), [
    ("responses", RESPONSE, ResponsesSummary),
    ("responses", with_(RESPONSE, status="incomplete",
                        incomplete_details={"reason": "max_output_tokens"}), ResponsesSummary),
    ("messages", MESSAGE, MessagesSummary),
    ("messages", with_(MESSAGE, stop_reason="max_tokens"), MessagesSummary)])
def test_the_stream_summary_rebuilds_the_replayed_body(endpoint, answer, summary_type):
    """What the gateway stores from a stream is what the JSON replay would have been:
    replaying the rebuilt body gives the same answer again."""
    body = as_json(answer, endpoint, "m", clock=lambda: 7.0)
    summary = summary_type()
    for frame in as_sse(answer, endpoint, "m", clock=lambda: 7.0):
        summary.observe(frame)
    rebuilt = summary.to_response()
    assert rebuilt is not None and response_storable(rebuilt)
    drop = {"id"}
    assert {k: v for k, v in rebuilt.items() if k not in drop} == \
        {k: v for k, v in body.items() if k not in drop}


def test_a_messages_stream_with_a_tool_block_is_not_rebuilt():
    frames = [b"event: message_start\ndata: " + json.dumps({"type": "message_start", "message": {
        **MESSAGE, "content": [], "stop_reason": None}}).encode() + b"\n\n"]
    for obj in ({"type": "content_block_start", "index": 0,
                 "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}},
                {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "input_json_delta", "partial_json": "{}"}},
                {"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                 "usage": {"output_tokens": 3}},
                {"type": "message_stop"}):
        frames.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    summary = MessagesSummary()
    for f in frames:
        summary.observe(f)
    assert summary.done and summary.content_chunks == 1
    assert summary.usage == {"input_tokens": 9, "output_tokens": 3}
    assert summary.to_response() is None
