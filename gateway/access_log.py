"""One structured JSON line per request on the ``sluice.access`` logger.

Fields: ``request_id`` (the gateway's), ``client_request_id`` (the client's
``x-request-id``, at most 64 characters of ``A-Za-z0-9._:-``, else null), ``path``
(the route), ``endpoint``, ``tenant``, ``model``, ``engine``, ``status``, ``outcome``,
``reason``, ``queue_ms``, ``ttft_ms``, ``duration_ms``, ``tokens_in``, ``tokens_out``,
``cache``, ``degraded`` — never a prompt, an answer or a key.
"""

from __future__ import annotations

import logging

import msgspec

from gateway.record import RequestRecord

log = logging.getLogger("sluice.access")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def access_line(rec: RequestRecord) -> str:
    """The JSON line for ``rec`` (compact, UTF-8)."""
    return msgspec.json.encode({
        "request_id": rec.request_id, "client_request_id": rec.client_request_id,
        "path": rec.path, "endpoint": rec.endpoint, "tenant": rec.tenant,
        "model": rec.model, "engine": rec.engine, "status": rec.status,
        "outcome": rec.outcome.value, "reason": rec.reason, "queue_ms": _ms(rec.queue_s),
        "ttft_ms": _ms(rec.ttft_s), "duration_ms": _ms(rec.duration_s),
        "tokens_in": rec.prompt_tokens, "tokens_out": rec.completion_tokens,
        "cache": rec.cache if rec.inference else None, "degraded": list(rec.degraded),
    }).decode()


def log_access(rec: RequestRecord) -> None:
    """Observer: write ``rec``'s line (at INFO) if the logger is enabled. The record is
    made directly (``Logger.makeRecord``, then ``handle``: the logger's filters and
    handlers as ``info`` would), without ``info``'s search of the stack for the
    caller, which costs more than the line itself."""
    if log.isEnabledFor(logging.INFO):
        log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, access_line(rec),
                                  None, None, "log_access"))
