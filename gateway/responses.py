"""The Responses API's stored conversations at the edge of the pipeline
(:mod:`cache.conversations`): a body's ``previous_response_id`` is expanded into the
conversation it names before parsing (:func:`expand_conversation`), and a finished
answer is kept for follow-ups (:func:`remember`). The Director calls both.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cache.conversations import ResponseStore, input_items
from cache.service import STORE_ERRORS
from config.schema import TenantQuota
from gateway.admission import NO_ENGINE_RETRY_S
from gateway.openai_api import InferenceRequest
from limits.outcome import Outcome, Rejected

log = logging.getLogger("sluice.director")

#: Longest ``previous_response_id`` looked up, characters (a longer one is left for
#: the body's validation to name).
MAX_ID_CHARS = 256


async def expand_conversation(store: ResponseStore, tenant: TenantQuota,
                              body: dict[str, Any]) -> dict[str, Any]:
    """A Responses body with ``previous_response_id`` replaced by the stored
    conversation it names, prepended to its ``input`` (the engine is sent the whole
    conversation; :mod:`cache.conversations`).

    Raises:
        Rejected: 404 ``not_found`` when the tenant has no such stored response;
            503 when the store cannot be read.
    """
    previous = body.get("previous_response_id")
    if not isinstance(previous, str) or not previous or len(previous) > MAX_ID_CHARS:
        return body  # absent, or the body's validation names it
    try:
        history = await store.history(tenant.namespace, previous)
    except STORE_ERRORS as e:
        raise Rejected(Outcome.OVERLOADED, "The conversation store is unavailable; retry "
                       "shortly.", retry_after_s=NO_ENGINE_RETRY_S,
                       reason="conversation_store") from e
    if history is None:
        raise Rejected(Outcome.NOT_FOUND, f"Previous response with id '{previous}' not "
                       "found.", param="previous_response_id")
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    out["input"] = [*history, *input_items(body.get("input"))]
    return out


def expander(store: ResponseStore, tenant: TenantQuota, endpoint: str,
             ) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None:
    """:func:`expand_conversation` for ``tenant``'s bodies of the ``responses``
    endpoint (the hook of :func:`gateway.intake.parse`); None for other endpoints."""
    if endpoint != "responses":
        return None
    return functools.partial(expand_conversation, store, tenant)


async def remember(store: ResponseStore, tenant: TenantQuota, req: InferenceRequest,
                   answer: dict[str, Any]) -> None:
    """Keep a finished Responses answer for follow-ups (unless ``store: false``); a
    store failure is logged, the answer still goes out."""
    if req.body.get("store") is False:
        return
    try:
        await store.put(tenant.namespace, input_items(req.body.get("input")), answer)
    except STORE_ERRORS as e:
        log.warning("response %s not stored: %r", answer.get("id"), e)
