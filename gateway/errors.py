"""OpenAI-style error bodies.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}``
with the status that :class:`limits.outcome.Outcome` maps it to; 429 and 503 carry an
integer ``Retry-After`` (seconds, at least 1).
"""

from __future__ import annotations

import json
import math

from aiohttp import web

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


def error_response(rej: Rejected) -> web.Response:
    """The HTTP response for a :class:`Rejected`."""
    return web.Response(
        status=rej.outcome.status,
        text=json.dumps(error_body(rej.outcome, rej.message, rej.param)),
        content_type="application/json",
        headers=retry_after_header(rej.outcome, rej.retry_after_s),
    )


def sse_error_event(outcome: Outcome, message: str) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error object, sent when a stream
    fails after its first byte (no ``[DONE]`` follows it)."""
    return b"data: " + json.dumps(error_body(outcome, message)).encode() + b"\n\n"
