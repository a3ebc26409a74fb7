"""OpenAI-style error bodies.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}``
with the status that :class:`limits.outcome.Outcome` maps it to; 429 and 503 carry an
integer ``Retry-After`` (seconds, at least 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.endpoints import anthropic_error_body
from limits.outcome import Outcome, Rejected


def error_body(outcome: Outcome, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": outcome.error_type,
            "param": param,
            "code": outcome.code,
        }
    }


def retry_after_header(outcome: Outcome, retry_after_s: float | None) -> dict[str, str]:
    """``{"Retry-After": "N"}`` for 429/503 (N = ceil, at least 1), else ``{}``."""
    if not outcome.needs_retry_after:
        return {}
    seconds = max(1, math.ceil(retry_after_s or 1))
    return {"Retry-After": str(seconds)}


def error_response(rej: Rejected, *, anthropic: bool = False) -> web.Response:
    """The HTTP response for a :class:`Rejected`; in Anthropic's error shape
    (:func:`gateway.endpoints.anthropic_error_body`) when ``anthropic``."""
    body = anthropic_error_body(rej.outcome.status, rej.message) if anthropic \
        else error_body(rej.outcome, rej.message, rej.param)
    return web.Response(
        status=rej.outcome.status,
        text=json.dumps(body),
        content_type="application/json",
        headers=retry_after_header(rej.outcome, rej.retry_after_s),
    )


def sse_error_event(outcome: Outcome, message: str, *, anthropic: bool = False) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error object, sent when a stream
    fails after its first byte (no ``[DONE]`` follows it); Anthropic's ``event:
    error`` when ``anthropic``."""
    if anthropic:
        return (b"event: error\ndata: " + json.dumps(anthropic_error_body(
            outcome.status, message)).encode() + b"\n\n")
    return b"data: " + json.dumps(error_body(outcome, message)).encode() + b"\n\n"


class _OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering requests it cannot parse (a header
    over ``max_field_size``, a malformed request line) in the OpenAI error shape
    instead of aiohttp's plain text; these never reach the middlewares.

    It also bounds how long a request head may take (``timeouts.request_head_s``,
    as nginx's ``client_header_timeout``): from the connection's opening, or from the
    first byte of a later request on a kept-alive connection, until the head is
    complete; past it the connection is closed without an answer (a client that never
    finishes its head cannot read one). Idle kept-alive connections are closed after
    ``timeouts.keepalive_s`` by aiohttp's own ``keepalive_timeout``.
    """

    head_timeout_s: float | None = None
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        idle = self._waiter is not None and not self._waiter.done() and not self._messages
        if idle and self._head_timer is None:  # the first byte of a new request head
            self._arm_head_timer()
        super().data_received(data)
        if self._messages or (self._waiter is not None and self._waiter.done()):
            self._disarm_head_timer()  # a whole head arrived

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self.head_timeout_s is not None:
            self._head_timer = self._loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._messages or self._waiter is None or self._waiter.done():
            return  # a request is being handled: its body has its own deadline
        logging.getLogger("sluice.http").debug(
            "closing a connection whose request head did not arrive within %g s",
            self.head_timeout_s)
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # what aiohttp does: the response is gone
            raise ConnectionError("Response is sent already, cannot send another response")
        outcome = Outcome.INVALID_REQUEST if status < 500 else Outcome.INTERNAL_ERROR
        logging.getLogger("sluice.http").info("unparseable request from %s: %s",
                                               request.remote, message or exc)
        text = (message or "The request could not be parsed.") if status < 500 \
            else "The gateway failed to handle the request."
        body = error_body(outcome, text)
        resp = web.Response(status=status, text=json.dumps(body),
                            content_type="application/json")
        resp.force_close()
        return resp


class _OpenAIErrorServer(web.Server):
    head_timeout_s: float | None = None

    def __call__(self) -> RequestHandler:
        handler = _OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)
        handler.head_timeout_s = self.head_timeout_s
        return handler


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer unparseable HTTP with OpenAI-style
    JSON errors and bound the request head and idle keep-alive (see
    :class:`_OpenAIErrorHandler`), with the app's ``gateway.timeouts``
    (``request_head_s``, ``keepalive_s``) unless ``keepalive_timeout`` is given."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        from gateway.keys import CONFIG  # gateway.keys imports modules that import this one

        timeouts = app[CONFIG].gateway.timeouts
        kwargs.setdefault("keepalive_timeout", timeouts.keepalive_s)
        super().__init__(app, **kwargs)
        self._head_timeout_s = timeouts.request_head_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer  # same object, OpenAI-shaped parse errors
        server.head_timeout_s = self._head_timeout_s
        return server
