"""Cache keys: what makes two requests "the same" for the exact and semantic caches.

Exact key
    SHA-256 over a canonical JSON document (sorted keys, no whitespace) of the tenant's
    cache namespace, the endpoint kind (:data:`EndpointKind`), the requested model,
    and the whole request body minus :data:`EXCLUDED_FIELDS`, after
    :func:`normalize_body` fills in OpenAI's defaults. Every other field, known or not,
    is part of the key (conservative: a field this gateway does not understand may
    change the output).

Semantic scope key
    The same document with the last user turn's text removed (chat only): the system
    prompt, every earlier turn, the model, the namespace and every parameter stay in
    the scope, so only the final question is compared by meaning.

Keys are hex digests and never leave the cache package (responses never carry them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

#: The endpoints the cache keys: chat and completions, embeddings, OpenAI Responses
#: (with ``previous_response_id`` already expanded into the conversation it names, so
#: the key covers the whole conversation) and Anthropic Messages.
EndpointKind = Literal["chat", "completions", "embeddings", "responses", "messages"]

#: Body fields that change transport or bookkeeping, never the generated text:
#: ``stream`` / ``stream_options`` (a cached answer is replayed either way),
#: ``user``, ``metadata``, ``store``, ``safety_identifier`` (end-user / logging tags),
#: ``service_tier``, ``priority`` (scheduling), ``prompt_cache_key`` and vLLM's
#: ``cache_salt`` (KV-cache routing and isolation; the tenant is in the key anyway).
EXCLUDED_FIELDS: frozenset[str] = frozenset({
    "stream", "stream_options", "user", "metadata", "store", "safety_identifier",
    "service_tier", "priority", "prompt_cache_key", "cache_salt",
})

#: OpenAI's documented defaults, applied when a field is absent or null so that an
#: omitted value and its explicit default give the same key. ``temperature`` absent
#: means 1.0 (not 0). Numbers are normalised to float so ``0`` and ``0.0`` agree.
DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logprobs": False,
}
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class CacheKey:
    """Keys of one request.

    Attributes:
        exact: hex SHA-256 of the whole normalised request (see module docstring).
        scope: hex SHA-256 of the request without its last user turn; None when the
            request has no semantic form (completions, or a last turn that is not
            plain user text).
        query: the last user turn's text, compared by meaning inside ``scope``;
            None exactly when ``scope`` is None.
    """

    exact: str
    scope: str | None
    query: str | None


def normalize_body(body: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``body`` without :data:`EXCLUDED_FIELDS`, with
    :data:`DEFAULTS` filled in, numeric sampling parameters as floats and ``stop``
    as a list (``"x"`` and ``["x"]`` mean the same to the engine)."""
    out = {k: v for k, v in body.items() if k not in EXCLUDED_FIELDS and v is not None}
    for name, default in DEFAULTS.items():
        out.setdefault(name, default)
    for name in _FLOAT_FIELDS:
        if isinstance(out[name], (int, float)) and not isinstance(out[name], bool):
            out[name] = float(out[name])
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def last_user_text(messages: Any) -> str | None:
    """The text of the last message if it is a user turn made only of text: a string
    ``content`` or a list of ``{"type": "text"}`` parts (joined by newlines). None
    otherwise (tool results, images, audio: those are not compared by meaning)."""
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    if set(last) - {"role", "content"}:
        return None  # a name or other field on the turn: keep it exact-only
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    return None


def _digest(doc: dict[str, Any]) -> str:
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def make_key(namespace: str, endpoint: EndpointKind, model: str,
             body: dict[str, Any]) -> CacheKey:
    """Build the :class:`CacheKey` of a request.

    Args:
        namespace: the tenant's cache namespace (``TenantQuota.namespace``).
        endpoint: :data:`EndpointKind` (only ``chat`` has a semantic form).
        model: the model the answer comes from (the one the engine was asked for).
        body: the JSON body as the client sent it (not modified).
    """
    params = normalize_body(body)
    params.pop("model", None)
    doc = {"v": 1, "ns": namespace, "endpoint": endpoint, "model": model, "body": params}
    exact = _digest(doc)
    query = last_user_text(params.get("messages")) if endpoint == "chat" else None
    if query is None:
        return CacheKey(exact=exact, scope=None, query=None)
    scoped = dict(params, messages=params["messages"][:-1])
    scope = _digest({**doc, "body": scoped, "semantic": True})
    return CacheKey(exact=exact, scope=scope, query=query)
