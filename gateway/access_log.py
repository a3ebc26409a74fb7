"""One structured JSON line per request on the ``sluice.access`` logger.

Fields: ``request_id``, ``tenant``, ``model``, ``engine``, ``status``, ``outcome``,
``reason``, ``queue_ms``, ``ttft_ms``, ``duration_ms``, ``tokens_in``, ``tokens_out``,
``cache``, ``degraded`` — never a prompt, an answer or a key.
"""

from __future__ import annotations

import json
import logging

from gateway.record import RequestRecord

log = logging.getLogger("sluice.access")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def access_line(rec: RequestRecord) -> str:
    """The JSON line for ``rec``."""
    return json.dumps({
        "request_id": rec.request_id, "path": rec.path, "tenant": rec.tenant,
        "model": rec.model, "engine": rec.engine, "status": rec.status,
        "outcome": rec.outcome.value, "reason": rec.reason, "queue_ms": _ms(rec.queue_s),
        "ttft_ms": _ms(rec.ttft_s), "duration_ms": _ms(rec.duration_s),
        "tokens_in": rec.prompt_tokens, "tokens_out": rec.completion_tokens,
        "cache": rec.cache if rec.inference else None, "degraded": list(rec.degraded),
    }, separators=(",", ":"))


def log_access(rec: RequestRecord) -> None:
    """Observer: write ``rec``'s line (at INFO) if the logger is enabled."""
    if log.isEnabledFor(logging.INFO):
        log.info(access_line(rec))
