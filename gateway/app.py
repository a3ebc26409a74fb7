"""The aiohttp application: ``create_app(cfg)`` and the HTTP routes.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(models with at least one ready engine that the tenant may use), ``GET /health``
(liveness: the process answers), ``GET /ready`` (every configured model has a ready
engine; 503 otherwise), ``GET /metrics`` (Prometheus; or on ``metrics_listen``),
``GET /admin/stats`` (the dashboard's feed; admin key).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from cache.service import open_cache
from config.schema import Config
from engines.kv_events import KVEventSubscribers
from engines.pool import EnginePool
from engines.prefix_events import EventPrefixIndex
from engines.scheduler import Scheduler
from engines.supervisor import Supervisor
from gateway.access_log import log_access
from gateway.admin import METRICS, STATS, metrics_app, metrics_handler, stats_handler
from gateway.auth import TenantDirectory
from gateway.dashboard import dashboard
from gateway.director import Director, Placement
from gateway.keys import CONFIG, OBSERVERS, POOL, SESSION, SPANS, TENANT, TENANTS
from gateway.metrics import FleetCollector, GatewayMetrics
from gateway.middlewares import auth_middleware, errors_middleware
from gateway.proxy import EngineClient
from gateway.reload import TenantReloader
from gateway.stats import StatsFeed
from gateway.tracing import make_tracer
from limits.admission import AdmissionQueue
from limits.clock import MonotonicClock
from limits.interfaces import CounterStore
from limits.rate_limit import RateLimiter
from limits.saturation import SaturationDetector
from limits.stores import open_store

DIRECTOR = web.AppKey("director", Director)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
RELOADER = web.AppKey("reloader", TenantReloader | None)
STORE = web.AppKey("store", CounterStore)
STARTED = int(time.time())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[DIRECTOR].handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[DIRECTOR].handle(request, "completions")


async def list_models(request: web.Request) -> web.Response:
    allowed = request[TENANT].allowed_models
    models = [m for m in request.app[POOL].ready_models() if allowed is None or m in allowed]
    return web.json_response({
        "object": "list",
        "data": [{"id": m, "object": "model", "created": STARTED, "owned_by": "sluice"}
                 for m in models],
    })


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    wanted = request.app[CONFIG].engines.model_names()
    have = set(pool.ready_models())
    missing = [m for m in wanted if m not in have]
    body = {
        "ready": not missing,
        "missing_models": missing,
        "engines": {e.id: e.state.value for e in pool.engines},
    }
    return web.json_response(body, status=503 if missing else 200)


def create_app(cfg: Config, *, model_cache_dir: Path | None = None,
               span_exporter: SpanExporter | None = None) -> web.Application:
    """Build the gateway app for ``cfg``. Engines are launched (or probed, for
    ``external`` ones) when the app starts and drained when it stops.
    ``span_exporter`` receives the traces (tests); otherwise traces go to the OTLP
    endpoint configured, or are not made."""
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware],
        client_max_size=cfg.gateway.max_body_bytes,
    )
    app[CONFIG] = cfg
    app[TENANTS] = TenantDirectory(cfg.tenants)
    app[POOL] = EnginePool()
    obs = cfg.gateway.observability
    cache_cfg = cfg.gateway.cache
    metrics = GatewayMetrics(cfg.engines.model_names(),
                             semantic=cache_cfg.enabled and cache_cfg.semantic.enabled)
    app[METRICS] = metrics
    app[OBSERVERS] = ([metrics.observe] if obs.metrics else []) + (
        [log_access] if obs.access_log else [])
    spans, provider = make_tracer(obs, span_exporter)
    app[SPANS] = spans

    def queues() -> dict[str, AdmissionQueue[Placement]]:
        return app[DIRECTOR].queues if DIRECTOR in app else {}

    metrics.registry.register(FleetCollector(
        app[POOL], queues, metrics, lambda: getattr(app.get(STORE), "failovers", 0)))
    app[STATS] = StatsFeed(metrics, app[POOL], queues,
                           lambda: app[RELOADER].history if app.get(RELOADER) else ())

    async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        app[SESSION] = session
        supervisor = Supervisor(cfg.engines, app[POOL], session, model_cache_dir=model_cache_dir)
        app[SUPERVISOR] = supervisor
        await supervisor.start()
        try:
            yield
        finally:
            await supervisor.stop(cfg.gateway.drain_grace_s)
            await session.close()

    async def pipeline_ctx(app: web.Application) -> AsyncIterator[None]:
        limits = cfg.gateway.limits
        store = open_store(limits.store_url, failure=limits.redis_failure,
                           timeout_s=limits.redis_timeout_s)
        clock = MonotonicClock()
        queues: dict[str, AdmissionQueue[Placement]] = {
            m: AdmissionQueue(m, cfg.gateway.queue, clock) for m in cfg.engines.model_names()}
        app[STORE] = store
        # loading the embedding model takes seconds: keep it off the event loop
        cache = await asyncio.to_thread(open_cache, cfg.gateway.cache) \
            if cfg.gateway.cache.enabled else None
        app[DIRECTOR] = Director(
            cfg, app[POOL], Scheduler(cfg.engines.scheduler),
            EngineClient(app[SESSION], cfg.gateway.timeouts),
            RateLimiter(store, lease_ttl_s=limits.lease_ttl_s), queues,
            SaturationDetector.from_config(cfg.engines), cache, spans)

        def kick() -> None:
            for q in queues.values():
                q.kick()

        app[POOL].listeners.append(kick)
        try:
            yield
        finally:
            app[POOL].listeners.remove(kick)
            for q in queues.values():
                q.close()
            if cache is not None:
                await cache.close()
            await store.close()

    async def kv_events_ctx(app: web.Application) -> AsyncIterator[None]:
        # every gateway process follows the engines' KV events into its own index
        index = app[DIRECTOR].scheduler.index
        subscribers = KVEventSubscribers(index) if isinstance(index, EventPrefixIndex) else None
        if subscribers is not None:
            subscribers.follow(app[POOL].engines)
        yield
        if subscribers is not None:
            await subscribers.stop()

    async def reload_ctx(app: web.Application) -> AsyncIterator[None]:
        path = cfg.paths.get("tenants")
        app[RELOADER] = TenantReloader(Path(path), app[TENANTS], metrics.on_reload) \
            if path else None
        tasks = [asyncio.create_task(app[STATS].run())]
        if path:
            tasks.append(asyncio.create_task(app[RELOADER].run()))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def metrics_listen_ctx(app: web.Application) -> AsyncIterator[None]:
        host, _, port = (obs.metrics_listen or "").rpartition(":")
        runner = web.AppRunner(metrics_app(metrics), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host or "127.0.0.1", int(port)).start()
        yield
        await runner.cleanup()

    async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        if provider is not None:
            provider.shutdown()

    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(pipeline_ctx)
    app.cleanup_ctx.append(kv_events_ctx)
    app.cleanup_ctx.append(reload_ctx)
    app.cleanup_ctx.append(tracing_ctx)
    if obs.metrics_listen:
        app.cleanup_ctx.append(metrics_listen_ctx)
    else:
        app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/admin/stats", stats_handler)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app
