"""What may be cached.

Requests
    A request is cacheable when it is deterministic — an explicit ``temperature`` of 0
    or a ``seed`` (vLLM reproduces seeded sampling) — or when the tenant opted in with
    ``cache.cache_sampled``. An omitted temperature is OpenAI's default 1.0, so it is
    *not* deterministic. ``n`` > 1 is cached under the same rule: ``n`` is part of the
    key and the stored response holds all ``n`` choices, replayed as they were.

Responses
    Only a complete answer is stored, and only one the replay (:mod:`cache.replay`)
    rebuilds exactly, as JSON and as a stream:

    * chat and completions: a JSON object without ``error``, with at least one choice,
      and every choice finished with ``stop`` or ``length``;
    * OpenAI Responses (``responses``): ``status`` ``completed`` (or ``incomplete``
      because it reached ``max_output_tokens``, as a chat choice's ``length``) and
      every output item an assistant ``message`` made of ``output_text`` parts;
    * Anthropic Messages (``messages``): a ``message`` whose ``stop_reason`` is
      ``end_turn``, ``max_tokens`` or ``stop_sequence`` and whose content is ``text``
      blocks;
    * embeddings: a ``list`` with at least one vector.

    Aborted or truncated streams, tool calls (``tool_calls``, ``function_call`` items,
    ``tool_use`` blocks: they ask the client to act and are cheap to regenerate),
    reasoning and thinking items, content filters and errors are never stored.
"""

from __future__ import annotations

from typing import Any

from config.schema import TenantCache

#: ``finish_reason`` values of a complete answer.
STORABLE_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length"})


#: Request fields whose output a streamed answer, reassembled, would not keep
#: (``StreamSummary.to_response`` rebuilds every delta field, not the per-token
#: ``logprobs``): such answers are not cached.
STREAM_LOSSY = frozenset({"logprobs", "top_logprobs"})

#: Endpoints the response cache serves (the others cost nothing to recompute:
#: tokenize, count_tokens).
CACHED_ENDPOINTS = frozenset({"chat", "completions", "embeddings", "responses", "messages"})

#: Anthropic ``stop_reason`` values of a complete answer (``tool_use`` asks the client
#: to act; ``pause_turn`` and ``refusal`` are not an answer to replay).
STORABLE_STOP_REASONS: frozenset[str] = frozenset({"end_turn", "max_tokens", "stop_sequence"})


def is_deterministic(body: dict[str, Any]) -> bool:
    """True when ``body`` asks for temperature 0 explicitly or carries a ``seed``."""
    if body.get("seed") is not None:
        return True
    t = body.get("temperature")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0


#: Endpoints whose answer depends on the request alone (no sampling).
DETERMINISTIC_ENDPOINTS: frozenset[str] = frozenset({"embeddings"})


def request_cacheable(body: dict[str, Any], tenant: TenantCache,
                      endpoint: str = "chat") -> bool:
    """Whether the cache may answer or keep this request for this tenant (an
    embeddings request always may: :data:`DETERMINISTIC_ENDPOINTS`)."""
    return tenant.enabled and (endpoint in DETERMINISTIC_ENDPOINTS
                               or is_deterministic(body) or tenant.cache_sampled)


def _text_items(items: Any, kind: str, parts_key: str | None, part_type: str) -> bool:
    """Whether ``items`` is a non-empty list of ``{"type": kind}`` objects (each with a
    list of ``part_type`` parts under ``parts_key``, when given) with string text."""
    if not isinstance(items, list) or not items:
        return False
    for item in items:
        if not isinstance(item, dict) or item.get("type") != kind:
            return False
        parts = item.get(parts_key) if parts_key else [item]
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == part_type
                and isinstance(p.get("text"), str) for p in parts):
            return False
    return True


def _cut_by_output_cap(response: dict[str, Any]) -> bool:
    """An OpenAI Response stopped at ``max_output_tokens``."""
    details = response.get("incomplete_details")
    return response.get("status") == "incomplete" and isinstance(details, dict) \
        and details.get("reason") == "max_output_tokens"


def response_storable(response: dict[str, Any]) -> bool:
    """Whether ``response`` (a non-streaming body of a chat, completions, embeddings,
    Responses or Messages request) is complete and rebuilt exactly by the replay (the
    module docstring)."""
    if not isinstance(response, dict) or response.get("error"):  # a Response has error: null
        return False
    if response.get("object") == "list":  # embeddings: every input's vector
        return isinstance(response.get("data"), list) and bool(response["data"])
    if response.get("object") == "response":
        return (response.get("status") == "completed" or _cut_by_output_cap(response)) \
            and _text_items(
            response.get("output"), "message", "content", "output_text")
    if response.get("type") == "message":
        return response.get("stop_reason") in STORABLE_STOP_REASONS and _text_items(
            response.get("content"), "text", None, "text")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(
        isinstance(c, dict) and c.get("finish_reason") in STORABLE_FINISH_REASONS
        for c in choices
    )


def cut_at_cap(response: dict[str, Any]) -> bool:
    """Whether ``response`` stopped at its output cap: a choice finished ``length``,
    a Messages ``stop_reason`` of ``max_tokens``, an ``incomplete`` Response."""
    if response.get("type") == "message":
        return response.get("stop_reason") == "max_tokens"
    if response.get("object") == "response":
        return _cut_by_output_cap(response)
    return any(isinstance(c, dict) and c.get("finish_reason") == "length"
               for c in response.get("choices") or ())
