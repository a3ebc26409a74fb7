"""What the proxy reads from an engine: SSE framing (one event at most
``max_event_bytes``, never a split character), the stream summary that rebuilds a
finished answer, and ``Retry-After``."""

from __future__ import annotations

import json

import pytest

from gateway.proxy import retry_after_s
from gateway.sse import EventFramer, EventTooLarge, StreamSummary


def test_framer_never_splits_utf8_and_keeps_the_tail():
    text = "naïve 日本語 🚀"
    stream = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w}}]},
                                              ensure_ascii=False).encode() + b"\n\n"
                      for w in text.split(" ")) + b"data: [DONE]\n\n"
    framer, events = EventFramer(1024), []
    for i in range(0, len(stream), 5):  # 5-byte reads cut characters apart
        events += framer.feed(stream[i:i + 5])
    assert framer.pending == b""
    summary = StreamSummary(chat=True)
    for e in events:
        summary.observe(e)
    assert summary.done and "".join(summary.texts[0]) == text.replace(" ", "")
    assert summary.content_chunks == 3


def test_framer_bounds_one_event_and_drops_it():
    framer = EventFramer(1024)
    assert framer.feed(b'data: {"a": 1}\n\ndata: {"x":"') == [b'data: {"a": 1}\n\n']
    assert framer.feed(b"y" * 1000) == []
    with pytest.raises(EventTooLarge):
        framer.feed(b"y" * 20)  # 12 + 1020 bytes, no end: past 1024
    assert framer.pending == b""
    with pytest.raises(EventTooLarge):  # a complete event past the bound, in one read
        framer.feed(b"data: " + b"z" * 2000 + b"\n\ndata: [DONE]\n\n")
    assert framer.feed(b"data: " + b"z" * 1000 + b"\n\n") == [b"data: " + b"z" * 1000 + b"\n\n"]


def test_retry_after_seconds_or_http_date():
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_summary_rebuilds_a_finished_answer_only():
    s = StreamSummary(chat=False)
    s.observe(b'data: {"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "text": "a"}]}\n\n')
    assert s.to_response() is None  # no finish reason yet
    s.observe(b'data: {"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}\n\n')
    s.observe(b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n')
    assert s.to_response() is None  # no [DONE]
    s.observe(b"data: [DONE]\n\n")
    r = s.to_response()
    assert r["choices"] == [{"index": 0, "text": "ab", "finish_reason": "stop"}]
    assert r["usage"]["completion_tokens"] == 2 and r["object"] == "text_completion"
