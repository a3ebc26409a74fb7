"""Middlewares, outermost first: request id and error mapping; authentication.

Any exception becomes an OpenAI-style error body: :class:`Rejected` with its own
outcome, aiohttp's HTTP exceptions by status (404, 405, 413), anything else a
logged 500 ``internal_error`` without a traceback in the body.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.auth import presented_key
from gateway.errors import error_response
from gateway.keys import CONFIG, REQUEST_ID, TENANT, TENANTS
from limits.outcome import Outcome, Rejected

log = logging.getLogger("sluice.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")

_HTTP_OUTCOMES = {
    404: (Outcome.NOT_FOUND, "Unknown path."),
    405: (Outcome.METHOD_NOT_ALLOWED, "Method not allowed for this path."),
    413: (Outcome.BODY_TOO_LARGE, "Request body is larger than the configured limit."),
}


def request_id_of(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _SAFE_ID.match(given) else uuid.uuid4().hex


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request_id_of(request)
    request[REQUEST_ID] = rid
    try:
        resp = await handler(request)
    except Rejected as rej:
        resp = error_response(rej)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        outcome, message = _HTTP_OUTCOMES.get(
            exc.status, (Outcome.INVALID_REQUEST, exc.reason or "Bad request.")
        )
        if exc.status == 413:
            limit = request.app[CONFIG].gateway.max_body_bytes
            message = f"Request body is larger than the limit of {limit} bytes."
        resp = error_response(Rejected(outcome, message))
    except Exception:
        log.exception("unhandled error in request %s", rid)
        resp = error_response(Rejected(Outcome.INTERNAL_ERROR, "Internal error; see gateway log "
                                       f"for request id {rid}."))
    if not resp.prepared:
        resp.headers["x-request-id"] = rid
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Resolve the tenant for ``/v1/`` paths; other paths are public or check their
    own (admin) key."""
    if request.path.startswith("/v1/"):
        request[TENANT] = request.app[TENANTS].resolve(presented_key(request), request.remote)
    return await handler(request)
