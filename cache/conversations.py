"""Responses API conversation state kept by the gateway: each stored response with
the input that produced it, so that a follow-up naming it in ``previous_response_id``
works on whichever gateway worker or replica receives it, and after the engine that
answered has restarted or left (an engine keeps stored responses in its own process
memory only, vLLM ``VLLM_ENABLE_RESPONSES_API_STORE``).

Records live in a :class:`~cache.interfaces.ByteStore` (the cache's ``store_url``:
``memory://`` per process, ``redis://`` shared), one JSON document per response under
``sluice:response:{namespace}:{id}``, expiring after ``cache.responses_ttl_s``.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from cache.interfaces import ByteStore

log = logging.getLogger(__name__)


def _key(namespace: str, response_id: str) -> str:
    return f"sluice:response:{namespace}:{response_id}"


def input_items(value: Any) -> list[Any]:
    """A Responses ``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value or [])


def output_as_input(output: Any) -> list[Any]:
    """A response's ``output`` items as the input items of the next turn: an output
    message becomes an assistant message with its text; reasoning items are dropped
    (OpenAI does not send them back either for a stateless chain); other items
    (function calls) are kept as they are."""
    items: list[Any] = []
    for item in output or ():
        if not isinstance(item, dict) or item.get("type") == "reasoning":
            continue
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content") or ()
                           if isinstance(p, dict) and isinstance(p.get("text", ""), str))
            items.append({"role": item.get("role", "assistant"), "content": text})
        else:
            items.append(item)
    return items


class ResponseStore:
    """Stored responses of each tenant namespace.

    Args:
        store: where the records live.
        ttl_s: how long a record is kept, s.
    """

    def __init__(self, store: ByteStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s

    async def get(self, namespace: str, response_id: str) -> dict[str, Any] | None:
        """The record ``{"input": [...], "response": {...}}`` of ``response_id`` in
        ``namespace``, or None.

        Raises:
            whatever the store raises (Redis down): the caller decides.
        """
        raw = await self.store.get(_key(namespace, response_id))
        if raw is None:
            return None
        try:
            record = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return None
        return record if isinstance(record, dict) else None

    async def history(self, namespace: str, response_id: str) -> list[Any] | None:
        """The conversation up to and including ``response_id`` as input items (its
        input, then its output), or None when it is not stored."""
        record = await self.get(namespace, response_id)
        if record is None:
            return None
        return [*record.get("input", ()), *output_as_input(
            (record.get("response") or {}).get("output"))]

    async def put(self, namespace: str, items: list[Any], response: dict[str, Any]) -> None:
        """Keep ``response`` (a complete Responses object with an ``id``) and the
        input ``items`` it answered."""
        response_id = response.get("id")
        if not isinstance(response_id, str) or not response_id:
            return
        await self.store.set(_key(namespace, response_id),
                             msgspec.json.encode({"input": items, "response": response}),
                             self.ttl_s)

    async def close(self) -> None:
        await self.store.close()
