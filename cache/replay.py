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
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from cache.keys import EndpointKind

_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-"}
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


def as_json(response: dict[str, Any], endpoint: EndpointKind, model: str,
            clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """The cached ``response`` as a non-streaming body for a request for ``model``
    (embeddings: as stored, with the model and the usage unchanged — an embeddings
    usage has no cached-token detail)."""
    out = copy.deepcopy(response)
    if endpoint == "embeddings":
        out["model"] = model
        return out
    out.update(id=_ID_PREFIX[endpoint] + secrets.token_hex(12), created=int(clock()),
               model=model)
    if "usage" in out:
        out["usage"] = cached_usage(out["usage"])
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


def as_sse(response: dict[str, Any], endpoint: EndpointKind, model: str,
           include_usage: bool = False, clock: Callable[[], float] = time.time
           ) -> Iterator[bytes]:
    """The cached ``response`` as SSE frames (``data: …\\n\\n``), ending with
    ``data: [DONE]``; ``include_usage`` mirrors ``stream_options.include_usage``."""
    body = as_json(response, endpoint, model, clock)
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
