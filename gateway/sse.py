"""Server-sent events as the OpenAI API uses them: ``data: {json}\\n\\n`` … ``data:
[DONE]\\n\\n``.

:class:`EventFramer` cuts a byte stream into whole events without decoding it (a
multi-byte UTF-8 character split between two network reads stays intact, because
the separator ``\\n\\n`` never occurs inside one) and bounds the size of one event
(an engine that never ends an event must not grow the gateway's memory).
:class:`StreamSummary` reads each
event's JSON for what the gateway must know: usage, finish reasons, the number of
chunks that carried generated output and the answer itself, every delta field
merged (to cache a finished answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]"


class EventTooLarge(Exception):
    """An event grew past the framer's ``max_event_bytes`` without ending."""


class EventFramer:
    """Splits bytes into complete SSE events (each returned with its terminating
    blank line). Only the unfinished tail is held back, at most ``max_event_bytes``.

    Raises (from :meth:`feed`):
        EventTooLarge: an event (complete or not) is longer than ``max_event_bytes``
            bytes; the held tail is dropped.
    """

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._tail + data if self._tail else data
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        tail = buf[end + 2 :] if end >= 0 else buf
        events = [e + b"\n\n" for e in buf[:end].split(b"\n\n") if e] if end >= 0 else []
        if len(tail) > self.max_event_bytes or (
                end > self.max_event_bytes and any(len(e) > self.max_event_bytes for e in events)):
            self._tail = b""
            raise EventTooLarge(f"an event is longer than {self.max_event_bytes} bytes")
        self._tail = tail
        return events

    @property
    def pending(self) -> bytes:
        return self._tail


def event_data(event: bytes) -> bytes:
    """The payload of an event's ``data:`` lines, joined by newlines (SSE spec)."""
    if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2:
        return event[5:-2].lstrip(b" ")  # one data line + blank line: the usual event
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines)


def _loads(payload: bytes) -> Any:
    """``json.loads(payload)``; an object's bytes are decoded as UTF-8 directly (what
    ``json.loads`` detects for any text starting with ``{``), skipping its encoding
    detection."""
    if payload[:1] == b"{":
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            return json.loads(payload)
        return json.loads(text)
    return json.loads(payload)


def merge_field(message: dict[str, Any], key: str, value: Any) -> bool:
    """Add one field of a chat stream's ``delta`` to ``message`` (the answer so far,
    as a non-streaming ``message``): strings (``reasoning_content``, ``reasoning``,
    ``refusal``, …) are concatenated, ``role`` kept, ``tool_calls`` merged by their
    ``index`` (``id``, ``type`` and ``function.name`` taken when first sent,
    ``function.arguments`` concatenated), nulls skipped. Returns False when the
    value is something this merge cannot rebuild exactly (any other value), so the
    answer must not be cached."""
    if value is None:
        return True
    if key == "tool_calls":
        return _merge_tool_calls(message.setdefault("tool_calls", {}), value)
    if key == "role" and isinstance(value, str):
        message["role"] = value
        return True
    if isinstance(value, str) and isinstance(message.get(key, ""), str):
        message[key] = message.get(key, "") + value
        return True
    return False


def _merge_tool_calls(calls: dict[int, dict[str, Any]], pieces: Any) -> bool:
    if not isinstance(pieces, list):
        return False
    for piece in pieces:
        if not isinstance(piece, dict) or not isinstance(piece.get("index", 0), int):
            return False
        call = calls.setdefault(piece.get("index", 0), {})
        for key, value in piece.items():
            if key == "index" or value is None:
                continue
            if key == "function" and isinstance(value, dict):
                function = call.setdefault("function", {})
                for name, part in value.items():
                    if not isinstance(part, str):
                        return False
                    function[name] = (function.get(name, "") + part if name == "arguments"
                                      else function.get(name) or part)
            elif isinstance(value, str):
                call.setdefault(key, value)
            else:
                return False
    return True


def generated(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a stream choice carries generated output: a chat delta with any
    non-empty field but ``role`` (content, reasoning, tool-call pieces, …), or a
    completions ``text``."""
    if not chat:
        return bool(choice.get("text"))
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")


def parse_event(payload: bytes) -> dict[str, Any] | None:
    """An event payload's JSON object, or None (``[DONE]``, empty, not an object)."""
    if not payload or payload == b"[DONE]":
        return None
    try:
        obj = _loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


@dataclass
class StreamSummary:
    """What was seen in a stream so far.

    Attributes:
        usage: the engine's usage object (from the usage-only chunk), or None.
        finish_reasons: per choice index, the finish reason once sent.
        content_chunks: choice chunks that carried generated output (:func:`generated`:
            content, reasoning, tool-call pieces, completions text; ≈ tokens streamed;
            the completion tokens of a stream cut short).
        done: ``[DONE]`` was seen.
        error: an error object the engine sent inside the stream, if any.
        texts: per choice index, the generated text pieces (chat ``content``,
            completions ``text``).
        fields: per choice index, every other field of the chat deltas merged
            (:func:`merge_field`: reasoning, tool calls, …).
        lossy: choice indices with a delta field :func:`merge_field` cannot rebuild.
    """

    chat: bool
    usage: dict[str, Any] | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    content_chunks: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    first: dict[str, Any] | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    fields: dict[int, dict[str, Any]] = field(default_factory=dict)
    lossy: set[int] = field(default_factory=set)

    def observe(self, event: bytes) -> dict[str, Any] | None:
        """Record one event; returns its parsed JSON (None for ``[DONE]``, comments
        and unparsable payloads, which are passed through untouched)."""
        payload = event_data(event)
        if payload == b"[DONE]":
            self.done = True
            return None
        if not payload:
            return None
        try:
            obj = _loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj and "choices" not in obj:
            self.error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            return obj
        if self.first is None:
            self.first = obj
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            idx = choice.get("index", 0)
            if generated(choice, self.chat):
                self.content_chunks += 1
            if self.chat:
                delta = choice.get("delta")
                for key, value in delta.items() if isinstance(delta, dict) else ():
                    if key == "content" and isinstance(value, str):
                        if value:
                            self.texts.setdefault(idx, []).append(value)
                    elif not merge_field(self.fields.setdefault(idx, {}), key, value):
                        self.lossy.add(idx)
            elif choice.get("text"):
                self.texts.setdefault(idx, []).append(choice["text"])
            if choice.get("finish_reason"):
                self.finish_reasons[idx] = choice["finish_reason"]
        return obj

    def to_response(self) -> dict[str, Any] | None:
        """The equivalent non-streaming response body, or None when the stream did
        not finish normally (no ``[DONE]``, an error, or a choice without a finish
        reason) or a choice held a delta that cannot be rebuilt exactly. A chat
        choice's ``message`` holds every delta field merged (:func:`merge_field`;
        ``content`` "" when none came), tool calls as a list in index order."""
        if not self.done or self.error or self.first is None or not self.finish_reasons:
            return None
        indices = sorted(set(self.texts) | set(self.fields) | set(self.finish_reasons))
        if any(i not in self.finish_reasons for i in indices) or self.lossy:
            return None
        choices = []
        for i in indices:
            text = "".join(self.texts.get(i, []))
            if self.chat:
                message = {"role": "assistant", **self.fields.get(i, {}), "content": text}
                if "tool_calls" in message:
                    message["tool_calls"] = [c for _, c in sorted(message["tool_calls"].items())]
                choices.append({"index": i, "message": message,
                                "finish_reason": self.finish_reasons[i]})
            else:
                choices.append({"index": i, "text": text,
                                "finish_reason": self.finish_reasons[i]})
        return {
            "id": self.first.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.first.get("created"),
            "model": self.first.get("model"),
            "choices": choices,
            "usage": self.usage,
        }
