"""Intake: what the Director checks of a request before the cache and admission
(docs/architecture.md, "One request", steps 2, 4 and 6): the body within its deadline,
the client's ``x-request-timeout``, the tenant's model access and token caps, and the
rate-limit reservation's size.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Container
from typing import Any

from aiohttp import web

from config.schema import TenantQuota
from gateway.openai_api import Endpoint, InferenceRequest, parse_json, parse_request, prompt_count
from limits.outcome import Outcome, Rejected
from limits.rate_limit import Sizing, reservation_size


async def read_body(request: web.Request, limit: float) -> bytes:
    """The request body, which must arrive within ``limit`` s (``timeouts.request_body_s``).

    Raises:
        Rejected: 408 ``request_timeout`` (a client that stalls mid-body would
            otherwise hold a connection, and shutdown, indefinitely).
    """
    if request.content.is_eof():  # all of it arrived with the head: nothing to wait for
        return await request.read()
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise Rejected(Outcome.REQUEST_TIMEOUT,
                       f"The request body did not arrive within {limit:g} s.") from None


async def parse(endpoint: Endpoint, raw: bytes, offload_bytes: int,
                expand: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None,
                ) -> InferenceRequest:
    """Parse and validate ``raw`` (``expand``, when given, rewrites the parsed body
    first: a Responses body's ``previous_response_id``,
    :func:`gateway.responses.expand_conversation`); in a worker thread when it is
    over ``offload_bytes`` (``gateway.offload_bytes``; JSON parsing costs ~8 ns per
    byte: 50 ms for 6 MB), which also marks the request ``large`` for the steps after
    it.

    Raises:
        Rejected: 400 for a body that is not valid JSON or not a valid request;
            what ``expand`` raises.
    """
    large = len(raw) > offload_bytes
    body = await asyncio.to_thread(parse_json, raw) if large else parse_json(raw)
    if expand is not None:
        body = await expand(body)
    req = (await asyncio.to_thread(parse_request, endpoint, body) if large
           else parse_request(endpoint, body))
    req.large = large
    return req


def request_timeout(request: web.Request) -> float | None:
    """The client's ``x-request-timeout``, s, or None.

    Raises:
        Rejected: 400 when it is not a positive number.
    """
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise Rejected(Outcome.INVALID_REQUEST, "x-request-timeout must be a positive number "
                       "of seconds.", param="x-request-timeout")
    return value


def check_model(tenant: TenantQuota, req: InferenceRequest, served: Container[str]) -> None:
    """``req``'s model is ``served`` and the tenant may use it.

    Raises:
        Rejected: 404 ``model_not_found``.
    """
    allowed = tenant.allowed_models
    if req.model not in served or (allowed is not None and req.model not in allowed):
        raise Rejected(
            Outcome.MODEL_NOT_FOUND,
            f"The model '{req.model}' does not exist or you do not have access to it.",
            param="model",
        )


def check_sequences(tenant: TenantQuota, req: InferenceRequest, max_sequences: int) -> None:
    """At most ``max_sequences`` (``gateway.max_sequences``, or the tenant's lower
    ``max_sequences``) sequences per request (prompts × max(n, best_of)), before any
    work on it.

    Raises:
        Rejected: 400 ``invalid_request`` naming ``prompt`` when the prompts alone
            exceed it, else ``n`` or ``best_of`` (whichever is larger)."""
    limit = min(max_sequences, tenant.max_sequences or math.inf)
    total = req.sequences
    if total <= limit:
        return
    prompts = prompt_count(req.endpoint, req.body)
    n, best_of = req.body.get("n") or 1, req.body.get("best_of") or 1
    param = "prompt" if prompts > limit else ("best_of" if best_of > n else "n")
    raise Rejected(
        Outcome.INVALID_REQUEST,
        f"This request asks for {total} sequences ({prompts} prompt(s) × "
        f"{max(n, best_of)} per prompt, the larger of 'n' and 'best_of'); at most "
        f"{int(limit)} are allowed per request.", param=param)


def apply_tenant_caps(tenant: TenantQuota, req: InferenceRequest) -> None:
    """The tenant's ``max_prompt_tokens`` and ``max_output_tokens``: an output cap
    the request lacks is set to the tenant's.

    Raises:
        Rejected: ``context_length_exceeded`` (prompt over the limit),
            ``invalid_request_error`` (output cap over the limit).
    """
    if tenant.max_prompt_tokens is not None and req.prompt_tokens > tenant.max_prompt_tokens:
        about = "" if req.prompt_exact else "about "
        raise Rejected(
            Outcome.CONTEXT_LENGTH_EXCEEDED,
            f"This request's prompt is {about}{req.prompt_tokens} tokens; your limit is "
            f"{tenant.max_prompt_tokens} tokens.",
            param=req.prompt_param,
        )
    cap = tenant.max_output_tokens
    if cap is None:
        return
    asked = req.max_output_tokens
    if asked is None:
        req.set_output_cap(cap)
    elif asked > cap:
        raise Rejected(
            Outcome.INVALID_REQUEST,
            f"'{req.output_field}' is {asked}; your limit is {cap} tokens.",
            param=req.output_field,
        )


def sizing(tenant: TenantQuota, req: InferenceRequest, default_output_tokens: int) -> Sizing:
    """The rate-limit reservation of ``req`` (:func:`limits.rate_limit.reservation_size`)."""
    return reservation_size(
        tenant, prompt_tokens=req.prompt_tokens, output_cap=req.max_output_tokens,
        sequences=req.sequences, default_output_tokens=default_output_tokens,
        output_param=req.output_field, prompt_param=req.prompt_param)
