"""What may be cached.

Requests
    A request is cacheable when it is deterministic — an explicit ``temperature`` of 0
    or a ``seed`` (vLLM reproduces seeded sampling) — or when the tenant opted in with
    ``cache.cache_sampled``. An omitted temperature is OpenAI's default 1.0, so it is
    *not* deterministic. ``n`` > 1 is cached under the same rule: ``n`` is part of the
    key and the stored response holds all ``n`` choices, replayed as they were.

Responses
    Only a complete answer is stored: a JSON object without ``error``, with at least one
    choice, and every choice finished with ``stop`` or ``length``. Aborted or truncated
    streams, tool calls still being produced (``tool_calls`` finishes are not cached
    either: they ask the client to act and are cheap to regenerate), content filters
    and errors are never stored.
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

#: Endpoints the response cache serves (the others' answers are sampled text whose
#: streams it cannot replay, or cost nothing to recompute).
CACHED_ENDPOINTS = frozenset({"chat", "completions", "embeddings"})


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


def response_storable(response: dict[str, Any]) -> bool:
    """Whether ``response`` (a non-streaming OpenAI chat, completions or embeddings
    body) is complete."""
    if not isinstance(response, dict) or "error" in response:
        return False
    if response.get("object") == "list":  # embeddings: every input's vector
        return isinstance(response.get("data"), list) and bool(response["data"])
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(
        isinstance(c, dict) and c.get("finish_reason") in STORABLE_FINISH_REASONS
        for c in choices
    )
