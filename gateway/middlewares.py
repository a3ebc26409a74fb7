"""Middlewares, outermost first: request record, request id and error mapping;
authentication.

Any exception becomes an OpenAI-style error body: :class:`Rejected` with its own
outcome, aiohttp's HTTP exceptions by status (404, 405, 413), anything else a
logged 500 ``internal_error`` without a traceback in the body. Every request that
reached ``/v1/`` is handed, once it ends, to the app's observers (metrics, access
log, stats feed) as a :class:`~gateway.record.RequestRecord`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind

from gateway.auth import presented_key
from gateway.endpoints import anthropic_path
from gateway.errors import error_response
from gateway.internal import INTERNAL_HEADER, TENANT_HEADER, batch_tenant, is_internal
from gateway.keys import CLOCK, CONFIG, OBSERVERS, RECORD, REQUEST_ID, SPANS, TENANT, TENANTS
from gateway.record import RequestRecord
from gateway.tracing import PROPAGATOR, finish_span
from limits.outcome import Outcome, Rejected

log = logging.getLogger("sluice.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")

_HTTP_OUTCOMES = {
    404: (Outcome.NOT_FOUND, "Unknown path."),
    405: (Outcome.METHOD_NOT_ALLOWED, "Method not allowed for this path."),
    413: (Outcome.BODY_TOO_LARGE, "Request body is larger than the configured limit."),
}


#: Generated request ids: a random 64-bit prefix per process, then a counter (32 hex
#: characters, like a UUID's; unique across processes and replicas with the odds of
#: a 64-bit collision, and without a system call per request as ``uuid4`` makes).
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNTER = itertools.count(secrets.randbits(32))


def request_id_of(request: web.Request) -> str:
    """A new id for this request (32 hex characters): the gateway's own, never the
    client's, so one id names one request even when clients reuse or forge
    ``x-request-id`` (what the client sent is :func:`client_request_id`)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFFFFFF:016x}"


#: At most this many characters of a client's ``x-request-id`` are recorded.
CLIENT_ID_MAX_CHARS = 64


def client_request_id(request: web.Request) -> str | None:
    """The client's ``x-request-id``, bounded for the access log: its first
    :data:`CLIENT_ID_MAX_CHARS` characters, each outside ``A-Za-z0-9._:-`` replaced
    by ``_``; None when absent or empty."""
    given = request.headers.get("x-request-id")
    if not given:
        return None
    return _UNSAFE_ID_CHARS.sub("_", given[:CLIENT_ID_MAX_CHARS])


#: HTTP methods named in span names as they are; any other is ``_OTHER`` (the
#: OpenTelemetry HTTP semantic conventions, ``http.request.method``).
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                      "TRACE", "PATCH"})


def route_of(request: web.Request) -> str:
    """The path of the app's route that matched ``request`` (its template, e.g.
    ``/v1/chat/completions``), or ``unmatched``: never the client's path, so a record,
    span name or label built from it takes one of the route table's values."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _error(request: web.Request, exc: BaseException, rid: str) -> web.Response:
    return error_response(_rejection(request, exc, rid), anthropic=anthropic_path(request.path))


def _rejection(request: web.Request, exc: BaseException, rid: str) -> Rejected:
    if isinstance(exc, Rejected):
        return exc
    if isinstance(exc, web.HTTPException):
        outcome, message = _HTTP_OUTCOMES.get(
            exc.status, (Outcome.INVALID_REQUEST, exc.reason or "Bad request."))
        if exc.status == 413:
            limit = request.app[CONFIG].gateway.max_body_bytes
            message = f"Request body is larger than the limit of {limit} bytes."
        return Rejected(outcome, message)
    log.error("unhandled error in request %s", rid, exc_info=exc)
    return Rejected(
        Outcome.INTERNAL_ERROR, f"Internal error; see the gateway log for request id {rid}.")


#: Paths outside ``/v1/`` that are API calls (vLLM's tokenizer endpoints).
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


def api_path(path: str) -> bool:
    """Whether ``path`` is an API call: authenticated, recorded, observed."""
    return path.startswith("/v1/") or path in TOKENIZER_PATHS


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request_id_of(request)
    request[REQUEST_ID] = rid
    clock = request.app[CLOCK]
    rec = RequestRecord(request_id=rid, path=route_of(request), started=clock.now(),
                        client_request_id=client_request_id(request))
    request[RECORD] = rec
    if not api_path(request.path):
        return await _run(request, handler, rec)
    spans = request.app[SPANS]
    parent = PROPAGATOR.extract(request.headers) if spans.enabled else None
    method = request.method if request.method in _METHODS else "_OTHER"
    with spans(f"{method} {rec.path}", context=parent, kind=SpanKind.SERVER) as span:
        try:
            return await _run(request, handler, rec)
        finally:
            rec.duration_s = clock.now() - rec.started
            finish_span(span, rec)
            for observe in request.app[OBSERVERS]:
                observe(rec)


async def _run(request: web.Request, handler: Handler, rec: RequestRecord) -> web.StreamResponse:
    try:
        resp = await handler(request)
    except asyncio.CancelledError:
        rec.outcome, rec.status = Outcome.CLIENT_DISCONNECTED, 499
        raise
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise
        resp = _error(request, exc, rec.request_id)
        if isinstance(exc, Rejected):
            rec.outcome, rec.reason = exc.outcome, exc.reason
        else:
            rec.outcome = _HTTP_OUTCOMES.get(getattr(exc, "status", 500),
                                             (Outcome.INTERNAL_ERROR, ""))[0]
    if not resp.prepared:
        resp.headers["x-request-id"] = rec.request_id
        if rec.inference and "x-sluice-cache" not in resp.headers:
            resp.headers["x-sluice-cache"] = rec.cache
    if rec.outcome is not Outcome.CLIENT_DISCONNECTED:
        rec.status = resp.status
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Resolve the tenant for ``/v1/`` paths; other paths are public or check their
    own (admin) key."""
    if api_path(request.path):
        internal = request.headers.get(INTERNAL_HEADER)
        if internal is None:
            tenant = request.app[TENANTS].resolve(presented_key(request), request.remote)
        elif is_internal(internal):
            # a batch line the gateway sends itself (gateway.batch_runner), to the
            # address it listens on (loopback, or the host's own address)
            tenant = batch_tenant(request.app[TENANTS].by_name(
                request.headers.get(TENANT_HEADER, "")), request.app[CONFIG].gateway.batch)
        else:
            raise Rejected(Outcome.UNAUTHORIZED, "Invalid internal credentials.")
        request[TENANT] = tenant
        request[RECORD].tenant = tenant.name
    return await handler(request)
