"""Operator endpoints: ``GET /metrics`` (Prometheus text) and ``GET /admin/stats``
(the dashboard's JSON feed).

``/admin/*`` needs an admin key (``Authorization: Bearer KEY`` or ``x-api-key``)
whose SHA-256 is listed in ``gateway.yaml`` ``admin_key_hashes``; with none listed,
admin endpoints answer loopback clients only.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.auth import hash_key, is_loopback, presented_key
from gateway.keys import CONFIG, METRICS, RUNNER, STATS
from gateway.metrics import GatewayMetrics
from limits.outcome import Outcome, Rejected


def require_admin(request: web.Request) -> None:
    """Raises:
        Rejected: 401 without a valid admin key (or, with no admin keys configured,
            for a client that is not on loopback).
    """
    hashes = request.app[CONFIG].gateway.admin_key_hashes
    key = presented_key(request)
    if not hashes:
        if is_loopback(request.remote):
            return
        raise Rejected(Outcome.UNAUTHORIZED, "Admin endpoints are open to loopback clients "
                       "only until admin_key_hashes is configured.")
    digest = hash_key(key).encode() if key else b""
    if not any([hmac.compare_digest(h.encode(), digest) for h in hashes]):
        raise Rejected(Outcome.UNAUTHORIZED, "A valid admin key is required.")


async def metrics_handler(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def stats_handler(request: web.Request) -> web.Response:
    require_admin(request)
    data = request.app[STATS].snapshot()
    if RUNNER in request.app:
        data["batches"] = request.app[RUNNER].panel()
    return web.json_response(data)


def metrics_app(metrics: GatewayMetrics) -> web.Application:
    """A separate app serving only ``/metrics`` (for ``observability.metrics_listen``)."""
    app = web.Application()
    app[METRICS] = metrics
    app.router.add_get("/metrics", metrics_handler)
    return app
