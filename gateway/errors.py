"""OpenAI-style error bodies.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}``
with the status that :class:`limits.outcome.Outcome` maps it to; 429 and 503 carry an
integer ``Retry-After`` (seconds, at least 1).
"""

from __future__ import annotations

import json
import logging
import math

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
    instead of aiohttp's plain text; these never reach the middlewares."""

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
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer unparseable HTTP with OpenAI-style
    JSON errors (see :class:`_OpenAIErrorHandler`)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer  # same object, OpenAI-shaped parse errors
        return server
