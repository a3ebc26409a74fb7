"""What the gateway reads from a relayed stream (gateway.sse.StreamSummary; issue 39
items 3 and 5): every chunk of generated output counts, and a finished chat stream
is rebuilt with every delta field, or not at all."""

from __future__ import annotations

import json
from typing import Any

from cache.replay import as_json, as_sse
from gateway.sse import StreamSummary


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0,
          text: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if text is not None:
        choice["text"] = text
    else:
        choice["delta"] = delta or {}
    return event({"id": "c1", "created": 1, "model": "m", "choices": [choice]})


def summary_of(events: list[bytes], chat: bool = True) -> StreamSummary:
    s = StreamSummary(chat=chat)
    for e in events:
        s.observe(e)
    return s


REASONED = [chunk({"role": "assistant", "content": ""}),
            *[chunk({"reasoning_content": w}) for w in ("first ", "I ", "think")],
            *[chunk({"content": w}) for w in ("it ", "is ", "4")],
            chunk({}, finish="stop"), b"data: [DONE]\n\n"]


def test_every_chunk_of_generated_output_counts() -> None:
    calls = [chunk({"tool_calls": [{"index": 0, "id": "x", "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]}),
             *[chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
               for p in ('{"a"', ': 1}')]]
    assert summary_of(REASONED[:-2]).content_chunks == 6  # 3 reasoning + 3 content
    assert summary_of(calls).content_chunks == 3
    assert summary_of([chunk(text="a"), chunk(text=""), chunk(text="b")],
                      chat=False).content_chunks == 2
    # the role chunk, an empty delta, a null content: no output
    assert summary_of([chunk({"role": "assistant", "content": ""}), chunk({}),
                       chunk({"content": None})]).content_chunks == 0


def test_a_reasoned_answer_is_rebuilt_and_replayed_whole() -> None:
    answer = summary_of(REASONED).to_response()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "it is 4",
                                               "reasoning_content": "first I think"}
    assert as_json(answer, "chat", "m")["choices"][0]["message"]["reasoning_content"] \
        == "first I think"
    replayed = summary_of(list(as_sse(answer, "chat", "m"))).to_response()
    assert replayed["choices"] == answer["choices"]


def test_tool_calls_are_merged_by_index() -> None:
    events = [chunk({"role": "assistant"}),
              chunk({"tool_calls": [{"index": 1, "id": "b", "type": "function",
                                     "function": {"name": "g", "arguments": "{"}}]}),
              chunk({"tool_calls": [{"index": 0, "id": "a", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}},
                                    {"index": 1, "function": {"arguments": "}"}}]}),
              chunk({}, finish="tool_calls"), b"data: [DONE]\n\n"]
    message = summary_of(events).to_response()["choices"][0]["message"]
    assert message["tool_calls"] == [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]


def test_a_delta_that_cannot_be_rebuilt_exactly_is_not_stored() -> None:
    odd = [chunk({"content": "x"}), chunk({"audio": {"id": "a1", "data": "AAA"}}),
           chunk({}, finish="stop"), b"data: [DONE]\n\n"]
    s = summary_of(odd)
    assert s.content_chunks == 2 and s.to_response() is None
