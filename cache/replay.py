"""Render a cached response for the client, as JSON or as an OpenAI SSE stream.

Whichever way the answer was first produced (plain JSON, or streamed and reassembled
into a non-streaming body by the gateway's ``StreamSummary.to_response``), a hit is
rendered from the stored non-streaming body:

* a fresh ``id`` and ``created`` (a replay is a new response), ``model`` = the model
  the client requested;
* usage **marked as served from cache**: the original ``prompt_tokens`` /
  ``completion_tokens`` / ``total_tokens`` are kept (they describe the answer), and
  ``prompt_tokens_details.cached_tokens`` = ``prompt_tokens`` — the OpenAI field for
  prompt tokens served from a cache. The gateway also sets ``x-sluice-cache:
  hit-exact|hit-semantic`` and charges no tokens for a hit.

SSE (``text/event-stream``), chat: per choice a role chunk (``delta.role``), one
content chunk (the whole message minus ``role``; tool calls get their ``index``; the
choice's ``logprobs`` ride on it), a finish chunk (empty delta, ``finish_reason``);
then, if ``stream_options.include_usage``, a chunk with ``choices: []`` and the usage
(all earlier chunks carry ``usage: null``, as OpenAI does); then ``data: [DONE]``.
Completions: per choice a text chunk and a finish chunk, then usage and ``[DONE]``.

OpenAI Responses (``responses``): a fresh ``resp_`` id and ``created_at``; usage keeps
its counts with ``input_tokens_details.cached_tokens`` = ``input_tokens``. Streamed as
the Responses API's events, each an ``event:`` line and a ``data:`` line with its
``sequence_number``: ``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, per part ``response.content_part.added``, one
``response.output_text.delta`` with the part's whole text, ``response.output_text.done``,
``response.content_part.done``, then ``response.output_item.done``, and
``response.completed`` (``response.incomplete`` for one cut at ``max_output_tokens``)
carrying the whole response (no ``[DONE]``).

Anthropic Messages (``messages``): a fresh ``msg_`` id; usage keeps ``output_tokens``
and moves the input to ``cache_read_input_tokens`` (Anthropic counts cache reads
apart from ``input_tokens``, which becomes 0). Streamed as Anthropic's events
(``event:`` and ``data:`` lines): ``message_start`` (the message without content, the
usage's input part), per block ``content_block_start``, one ``content_block_delta``
(``text_delta`` with the block's whole text), ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence``, the usage) and ``message_stop``.
Which answers are stored (and so replayed) is :func:`cache.policy.response_storable`:
only ones made of text, which these events rebuild exactly.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from cache.keys import EndpointKind

_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_",
              "messages": "msg_"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def cached_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """``usage`` with ``prompt_tokens_details.cached_tokens`` = ``prompt_tokens``."""
    if usage is None:
        return None
    out = copy.deepcopy(usage)
    details = dict(out.get("prompt_tokens_details") or {})
    details["cached_tokens"] = out.get("prompt_tokens", 0)
    out["prompt_tokens_details"] = details
    return out


def _responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    out = dict(usage)
    out["input_tokens_details"] = {**(usage.get("input_tokens_details") or {}),
                                   "cached_tokens": usage.get("input_tokens", 0)}
    return out


def _messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    read = (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0)
    return {**usage, "input_tokens": 0, "cache_read_input_tokens": read}


def as_json(response: dict[str, Any], endpoint: EndpointKind, model: str,
            clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """The cached ``response`` as a non-streaming body for a request for ``model``
    (embeddings: as stored, with the model and the usage unchanged — an embeddings
    usage has no cached-token detail; the other endpoints: the module docstring)."""
    out = copy.deepcopy(response)
    out["model"] = model
    if endpoint == "embeddings":
        return out
    out["id"] = _ID_PREFIX[endpoint] + secrets.token_hex(12)
    usage = out.get("usage")
    if endpoint == "responses":
        out["created_at"] = int(clock())
        if isinstance(usage, dict):
            out["usage"] = _responses_usage(usage)
    elif endpoint == "messages":
        if isinstance(usage, dict):
            out["usage"] = _messages_usage(usage)
    else:
        out["created"] = int(clock())
        if "usage" in out:
            out["usage"] = cached_usage(usage)
    return out


def _frame(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"),
                                                         ensure_ascii=False)
    return b"data: " + data.encode("utf-8") + b"\n\n"


def _chat_deltas(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
    message = choice.get("message") or {}
    yield {"delta": {"role": message.get("role", "assistant"), "content": ""}}
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(delta["tool_calls"])]
    yield {"delta": delta, "logprobs": choice.get("logprobs")}
    yield {"delta": {}, "finish_reason": choice.get("finish_reason")}


def _completion_deltas(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield {"text": choice.get("text", ""), "logprobs": choice.get("logprobs")}
    yield {"text": "", "finish_reason": choice.get("finish_reason")}


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode("ascii") + b"\n" + _frame({"type": name, **obj})


def _responses_events(body: dict[str, Any]) -> Iterator[bytes]:
    head = {**body, "status": "in_progress", "output": [], "usage": None}
    events: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": head}),
                                                ("response.in_progress", {"response": head})]
    for oi, item in enumerate(body.get("output") or []):
        events.append(("response.output_item.added", {"output_index": oi, "item": {
            **item, "status": "in_progress", "content": []}}))
        for ci, part in enumerate(item.get("content") or []):
            at = {"item_id": item.get("id"), "output_index": oi, "content_index": ci}
            events += [
                ("response.content_part.added", {**at, "part": {**part, "text": ""}}),
                ("response.output_text.delta", {**at, "delta": part["text"], "logprobs": []}),
                ("response.output_text.done", {**at, "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {**at, "part": part})]
        events.append(("response.output_item.done", {"output_index": oi, "item": item}))
    end = "response.incomplete" if body.get("status") == "incomplete" else "response.completed"
    events.append((end, {"response": body}))
    for n, (name, obj) in enumerate(events):
        yield _event(name, {**obj, "sequence_number": n})


def _messages_events(body: dict[str, Any]) -> Iterator[bytes]:
    usage = body.get("usage") or {}
    start_usage = {k: v for k, v in usage.items() if k != "output_tokens"}
    yield _event("message_start", {"message": {
        **body, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**start_usage, "output_tokens": 0}}})
    for i, block in enumerate(body.get("content") or []):
        yield _event("content_block_start", {"index": i, "content_block": {**block, "text": ""}})
        yield _event("content_block_delta", {"index": i, "delta": {
            "type": "text_delta", "text": block["text"]}})
        yield _event("content_block_stop", {"index": i})
    yield _event("message_delta", {"delta": {"stop_reason": body.get("stop_reason"),
                                             "stop_sequence": body.get("stop_sequence")},
                                   "usage": usage})
    yield _event("message_stop", {})


def as_sse(response: dict[str, Any], endpoint: EndpointKind, model: str,
           include_usage: bool = False, clock: Callable[[], float] = time.time
           ) -> Iterator[bytes]:
    """The cached ``response`` as SSE frames (chat and completions: ``data: …\\n\\n``
    chunks ending with ``data: [DONE]``, ``include_usage`` mirroring
    ``stream_options.include_usage``; Responses and Messages: their named events, the
    module docstring)."""
    return as_sse_of(as_json(response, endpoint, model, clock), endpoint, include_usage)


def as_sse_of(body: dict[str, Any], endpoint: EndpointKind,
              include_usage: bool = False) -> Iterator[bytes]:
    """:func:`as_sse` of a body :func:`as_json` already rendered."""
    if endpoint == "responses":
        yield from _responses_events(body)
        return
    if endpoint == "messages":
        yield from _messages_events(body)
        return
    model = body["model"]
    head = {"id": body["id"], "object": _CHUNK_OBJECT[endpoint], "created": body["created"],
            "model": model}
    if include_usage:
        head["usage"] = None
    deltas = _chat_deltas if endpoint == "chat" else _completion_deltas
    for i, choice in enumerate(body.get("choices", [])):
        for part in deltas(choice):
            entry = {"index": choice.get("index", i), "logprobs": None, "finish_reason": None}
            entry.update(part)
            yield _frame({**head, "choices": [entry]})
    if include_usage:
        yield _frame({**head, "choices": [], "usage": body.get("usage")})
    yield _frame("[DONE]")
