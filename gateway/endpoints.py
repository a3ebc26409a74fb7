"""The answer side of the endpoint adapters: what the pipeline reads from each
endpoint's answer — its usage, its stream's events, its error shape. The request side
(bodies, prompt, output cap) is :mod:`gateway.openai_api`; the pipeline itself
(:mod:`gateway.director`) is the same for every endpoint.

Usage per endpoint, as (prompt tokens, generated tokens, prompt tokens the engine's
prefix cache served):

* chat, completions, embeddings: ``usage.prompt_tokens`` / ``completion_tokens`` /
  ``prompt_tokens_details.cached_tokens`` (OpenAI; embeddings have no completion);
* responses: ``usage.input_tokens`` / ``output_tokens`` /
  ``input_tokens_details.cached_tokens`` (OpenAI Responses; vLLM
  ``responses/protocol.py`` ``ResponseUsage``);
* messages: ``usage.input_tokens`` / ``output_tokens`` / ``cache_read_input_tokens``
  (Anthropic; vLLM ``anthropic/protocol.py`` ``AnthropicUsage``).

Streams: chat and completions are :class:`gateway.sse.StreamSummary`; Responses
events (``event: response.output_text.delta`` … ``response.completed`` carrying the
whole response) are :class:`ResponsesSummary`; Anthropic events (``message_start``
with the input tokens … ``message_delta`` with the output tokens, ``message_stop``)
are :class:`MessagesSummary`. None of them ends with ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.sse import StreamSummary, event_data, parse_event

#: Response-ending event types of an OpenAI Responses stream.
RESPONSE_END = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_counts(endpoint: str, usage: Mapping[str, Any] | None) -> tuple[int, int, int | None] | None:
    """``(prompt, generated, cached)`` tokens of an answer's ``usage`` object for
    ``endpoint`` (see the module docstring), or None when there is none."""
    if not isinstance(usage, Mapping) or not usage:
        return None
    if endpoint in ("responses", "messages"):
        prompt, out = usage.get("input_tokens"), usage.get("output_tokens")
        if endpoint == "messages":
            cached = _int(usage.get("cache_read_input_tokens"))
        else:
            details = usage.get("input_tokens_details")
            cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    else:
        prompt, out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return _int(prompt) or 0, _int(out) or 0, cached


class Summary(Protocol):
    """What the relay reads from a stream (:class:`gateway.sse.StreamSummary`'s
    interface)."""

    usage: dict[str, Any] | None
    finish_reasons: dict[int, str]
    content_chunks: int
    done: bool
    error: dict[str, Any] | None

    def observe(self, event: bytes) -> dict[str, Any] | None: ...

    def to_response(self) -> dict[str, Any] | None: ...


@dataclass
class ResponsesSummary:
    """An OpenAI Responses stream: text deltas count as generated chunks; the ending
    event (:data:`RESPONSE_END`) carries the whole response (its usage, and the
    answer the gateway keeps for ``previous_response_id``)."""

    usage: dict[str, Any] | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    content_chunks: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    response: dict[str, Any] | None = None

    def observe(self, event: bytes) -> dict[str, Any] | None:
        obj = parse_event(event_data(event))
        if obj is None:
            return None
        kind = obj.get("type")
        if kind == "response.output_text.delta" and obj.get("delta"):
            self.content_chunks += 1
        elif kind in RESPONSE_END and isinstance(obj.get("response"), dict):
            self.response = obj["response"]
            self.usage = self.response.get("usage")
            self.finish_reasons[0] = self.response.get("status") or "completed"
            self.done = True
            if kind == "response.failed":
                self.error = self.response.get("error") or {"message": "response failed"}
        elif kind == "error":
            self.error = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        return obj

    def to_response(self) -> dict[str, Any] | None:
        return self.response if self.done and self.error is None else None


@dataclass
class MessagesSummary:
    """An Anthropic Messages stream: ``message_start`` carries the message and the
    input tokens, text deltas count as generated chunks, ``message_delta`` the final
    usage and stop reason, ``message_stop`` ends it. :meth:`to_response` rebuilds the
    non-streaming message (for the response cache) when every block was text; a stream
    with other blocks (``tool_use``, ``thinking``) is not rebuilt (the cache keeps only
    what its replay renders exactly: :func:`cache.policy.response_storable`)."""

    usage: dict[str, Any] | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    content_chunks: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    message: dict[str, Any] | None = None
    stop_sequence: str | None = None
    #: the text of each block by its index; None once a block is not text
    texts: dict[int, list[str]] | None = field(default_factory=dict)

    def observe(self, event: bytes) -> dict[str, Any] | None:
        obj = parse_event(event_data(event))
        if obj is None:
            return None
        kind = obj.get("type")
        if kind == "content_block_delta":
            self.content_chunks += 1
            self._text(obj.get("index"), obj.get("delta"), "text_delta")
        elif kind == "content_block_start":
            self._text(obj.get("index"), obj.get("content_block"), "text")
        elif kind == "message_start" and isinstance(obj.get("message"), dict):
            self.message = obj["message"]
            self.usage = {**(obj["message"].get("usage") or {})}
        elif kind == "message_delta":
            self.usage = {**(self.usage or {}), **(obj.get("usage") or {})}
            delta = obj.get("delta") or {}
            if delta.get("stop_reason"):
                self.finish_reasons[0] = delta["stop_reason"]
            self.stop_sequence = delta.get("stop_sequence")
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.error = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        return obj

    def _text(self, index: Any, part: Any, text_type: str) -> None:
        if self.texts is None:
            return
        if (not isinstance(index, int) or not isinstance(part, dict)
                or part.get("type") != text_type or not isinstance(part.get("text"), str)):
            self.texts = None  # a block the rebuild does not cover
            return
        self.texts.setdefault(index, []).append(part["text"])

    def to_response(self) -> dict[str, Any] | None:
        """The whole message as a non-streaming body, or None (not finished, an
        error, a block that is not text)."""
        if not self.done or self.error is not None or self.message is None or not self.texts:
            return None
        content = [{"type": "text", "text": "".join(self.texts[i])} for i in sorted(self.texts)]
        return {**self.message, "content": content,
                "stop_reason": self.finish_reasons.get(0),
                "stop_sequence": self.stop_sequence, "usage": self.usage}


def stream_summary(endpoint: str) -> Summary:
    """A fresh summary for a stream of ``endpoint``."""
    if endpoint == "responses":
        return ResponsesSummary()
    if endpoint == "messages":
        return MessagesSummary()
    return StreamSummary(chat=endpoint == "chat")


# ---------------------------------------------------------------- Anthropic errors

#: HTTP status → Anthropic error ``type`` (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   502: "api_error", 503: "overloaded_error", 504: "api_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for ``status``."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape (``/v1/messages…``)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")
