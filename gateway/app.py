"""The aiohttp application: ``create_app(cfg)`` and the HTTP routes.

Routes: the inference endpoints of :data:`gateway.openai_api.PATHS` (``POST
/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages``,
``/v1/messages/count_tokens``, ``/v1/embeddings``, ``/tokenize``, ``/detokenize``: each
the one pipeline of :class:`~gateway.director.Director` with its endpoint's adapter),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` (the gateway's
stored responses), ``GET /v1/models`` (models with at least one ready engine that the
tenant may use, as their engines describe them), ``GET /health``
(liveness: the process answers, with its ``pid`` and ``worker`` index), ``GET /ready``
(every configured model has a ready engine; 503 otherwise), ``GET /metrics``
(Prometheus; or on ``metrics_listen``), ``GET /admin/stats`` (the dashboard's feed;
admin key), ``GET /admin/capacity`` (the capacity report from the learned latency
models; admin key).

:func:`create_app` builds everything that needs no event loop — the scheduler (so a
bad plugin fails before any engine starts), admission queues, counter store, metrics
and their collectors — and registers the module-level ``cleanup_ctx`` functions below,
which start and stop the rest in order: engines, request pipeline, KV-event
subscribers, background tasks, tracing, the separate metrics listener. Every key is in :mod:`gateway.keys`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from cache.conversations import ResponseStore
from cache.service import STORE_ERRORS, open_byte_store, open_cache
from config.loader import ConfigError, check_cross_refs
from config.schema import PRIORITIES, Config, EnginesConfig, TenantsConfig
from engines.kv_events import KVEventSubscribers
from engines.pool import Engine, EnginePool
from engines.prefix_events import EventPrefixIndex
from engines.scheduler import Scheduler
from engines.supervisor import Supervisor
from gateway.access_log import log_access
from gateway.admin import metrics_app, metrics_handler, require_admin, stats_handler
from gateway.auth import TenantDirectory
from gateway.batch_api import add_routes as add_batch_routes
from gateway.dashboard import dashboard
from gateway.director import Director
from gateway.keys import (
    CLOCK,
    CONFIG,
    DIRECTOR,
    LIMITER,
    METRICS,
    MODEL_CACHE_DIR,
    MODEL_CARDS,
    OBSERVERS,
    POOL,
    QUEUES,
    RELOADER,
    SCHEDULER,
    SESSION,
    SLO_GATE,
    SPANS,
    STATS,
    STORE,
    SUPERVISOR,
    TENANT,
    TENANTS,
    TRACER_PROVIDER,
    WORKER,
)
from gateway.metrics import FleetCollector, GatewayMetrics
from gateway.middlewares import auth_middleware, errors_middleware
from gateway.models import ModelCards
from gateway.openai_api import PATHS, Endpoint
from gateway.proxy import EngineClient
from gateway.reload import ConfigReloader, reloadable_engines
from gateway.stats import StatsFeed
from gateway.tracing import make_tracer
from gateway.workers import WorkerRole
from limits.admission import AdmissionQueue
from limits.clock import MONOTONIC
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter
from limits.saturation import SaturationDetector
from limits.slo_gate import SloGate
from limits.stores import open_store

STARTED = int(time.time())
log = logging.getLogger("sluice.app")


def _inference(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The route handler of an inference endpoint: the one pipeline
    (:meth:`Director.handle`) with that endpoint's adapter."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[DIRECTOR].handle(request, endpoint)
    handler.__name__ = endpoint
    return handler


async def _stored_response(request: web.Request) -> dict:
    """The tenant's stored Responses object named in the path.

    Raises:
        Rejected: 404 when the tenant has no such stored response; 503 when the
            conversation store cannot be read.
    """
    response_id = request.match_info["response_id"]
    try:
        record = await request.app[DIRECTOR].responses.get(request[TENANT].namespace,
                                                           response_id)
    except STORE_ERRORS:
        raise Rejected(Outcome.OVERLOADED, "The conversation store is unavailable; retry "
                       "shortly.", reason="conversation_store") from None
    if record is None or not isinstance(record.get("response"), dict):
        raise Rejected(Outcome.NOT_FOUND, f"Response with id '{response_id}' not found.")
    return record["response"]


async def get_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: a response the gateway stored for this tenant
    (:mod:`cache.conversations`), whichever worker or engine produced it."""
    return web.json_response(await _stored_response(request))


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``: only background responses can be
    cancelled (OpenAI), and the gateway runs none (``background: true`` is the
    engine's 400): a stored response answers 400, an unknown one 404."""
    await _stored_response(request)
    raise Rejected(Outcome.INVALID_REQUEST, "Only responses created with background=true "
                   "can be cancelled; this gateway serves no background responses.")


async def admin_capacity(request: web.Request) -> web.Response:
    """``GET /admin/capacity[?model=M][&rate=R]``: per engine, the learned knee per
    SLO band, the ``--max-num-seqs`` it implies and the throughput on the observed
    mix; with ``rate`` (requests/s), the engines of each kind that rate needs and
    their price (:mod:`limits.capacity`). Admin key as ``/admin/stats``."""
    require_admin(request)
    director = request.app[DIRECTOR]
    raw_rate = request.query.get("rate")
    try:
        rate = float(raw_rate) if raw_rate is not None else None
    except ValueError:
        rate = -1.0
    if rate is not None and not (rate > 0 and rate < float("inf")):
        raise Rejected(Outcome.INVALID_REQUEST, "rate must be a positive number of "
                       "requests per second.", param="rate")
    models = list(director.queues)
    wanted = request.query.get("model")
    if wanted is not None and wanted not in models:
        raise Rejected(Outcome.MODEL_NOT_FOUND, f"The model '{wanted}' is not served.",
                       param="model")
    return web.json_response({"models": [director.capacity.report(m, rate)
                                         for m in ([wanted] if wanted else models)]})


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: one entry per served model with a ready engine that the
    tenant may use, as an engine of it describes the model (``max_model_len``,
    ``root``, ``created``, ``owned_by``: :class:`gateway.models.ModelCards`)."""
    allowed = request[TENANT].allowed_models
    pool = request.app[POOL]
    models = [m for m in pool.ready_models() if allowed is None or m in allowed]
    cards = request.app[MODEL_CARDS]
    data = await asyncio.gather(*(cards.card(m, pool.for_model(m)) for m in models))
    return web.json_response({"object": "list", "data": list(data)})


async def health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    return web.json_response({"status": "ok", "pid": os.getpid(),
                              "worker": worker.index if worker else 0})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    wanted = list(request.app[QUEUES])  # the served models, as last (re)loaded
    have = set(pool.ready_models())
    missing = [m for m in wanted if m not in have]
    body = {
        "ready": not missing,
        "missing_models": missing,
        "engines": {e.id: e.state.value for e in pool.engines},
    }
    return web.json_response(body, status=503 if missing else 200)


def create_app(cfg: Config, *, model_cache_dir: Path | None = None,
               span_exporter: SpanExporter | None = None,
               clock: Clock = MONOTONIC,
               worker: WorkerRole | None = None) -> web.Application:
    """Build the gateway app for ``cfg``. Engines are launched (or probed, for
    ``external`` ones) when the app starts and drained when it stops.

    Args:
        cfg: the loaded configuration.
        model_cache_dir: where ``packaged:`` models are prepared (None: default).
        span_exporter: receives the traces (tests); otherwise traces go to the OTLP
            endpoint configured, or are not made.
        clock: the one monotonic clock (s) read by the request path, the admission
            queues, the engines' supervisor and the placement (tests inject their own).
        worker: this process's place under ``sluice serve --workers N``: only worker
            0 launches the engines, the others follow their address file
            (:mod:`gateway.workers`); None: the only process.

    Raises:
        ValueError: the scheduler's plugins cannot be built (the configuration
            schema normally rejected them when it loaded).
    """
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware],
        client_max_size=cfg.gateway.max_body_bytes,
    )
    obs, limits, cache_cfg = cfg.gateway.observability, cfg.gateway.limits, cfg.gateway.cache
    app[CONFIG] = cfg
    app[MODEL_CACHE_DIR] = model_cache_dir
    app[WORKER] = worker
    app[TENANTS] = TenantDirectory(cfg.tenants)
    app[POOL] = EnginePool()
    app[SCHEDULER] = Scheduler(cfg.engines.scheduler)
    app[CLOCK] = clock
    app[QUEUES] = {m: AdmissionQueue(model=m, config=cfg.gateway.queue, clock=clock)
                   for m in cfg.engines.model_names()}
    app[STORE] = open_store(limits.store_url, failure=limits.redis_failure,
                            timeout_s=limits.redis_timeout_s, clock=clock,  # connects lazily
                            max_pending_releases=limits.max_pending_releases)
    app[LIMITER] = RateLimiter(store=app[STORE], lease_ttl_s=limits.lease_ttl_s)
    #: the SLO gate: the adaptive admission's ledgers and band demand (read by the
    #: metrics, the stats feed and the capacity report; the director's placer decides)
    app[SLO_GATE] = SloGate(slo=cfg.gateway.slo, adaptive=cfg.engines.saturation.adaptive,
                            clock=clock, retry_after=lambda m: app[QUEUES][m].retry_after_s())
    metrics = GatewayMetrics(models=cfg.engines.model_names(),
                             semantic=cache_cfg.enabled and cache_cfg.semantic.enabled)
    app[METRICS] = metrics
    tightest_tpot_s = min(cfg.gateway.slo.target(p).tpot_s for p in PRIORITIES)
    metrics.registry.register(FleetCollector(
        pool=app[POOL], queues=app[QUEUES], metrics=metrics, store=app[STORE],
        limiter=app[LIMITER], tpot_target_s=tightest_tpot_s,
        desired_engines=lambda m: app[DIRECTOR].capacity.desired_engines(m) if DIRECTOR in app else None,
        prefill_held=lambda: app[DIRECTOR].placer.disagg.queue.held if DIRECTOR in app else {},
        gate=app[SLO_GATE]))
    app[OBSERVERS] = ([metrics.observe] if obs.metrics else []) + (
        [log_access] if obs.access_log else [])
    app[SPANS], app[TRACER_PROVIDER] = make_tracer(obs, span_exporter)
    watched = {kind: (Path(path), apply) for kind, path, apply in (
        ("tenants", cfg.paths.get("tenants"), app[TENANTS].replace),
        ("engines", cfg.paths.get("engines"), lambda new: reload_engines(app, new)),
    ) if path}
    app[RELOADER] = ConfigReloader(watched, on_result=metrics.on_reload) if watched else None
    app[POOL].on_remove.append(metrics.forget_engine)
    app[STATS] = StatsFeed(metrics=metrics, pool=app[POOL], queues=app[QUEUES],
                           reloads=app[RELOADER].history if app[RELOADER] else (),
                           tpot_target_s=tightest_tpot_s, gate=app[SLO_GATE])
    app[POOL].on_remove.append(app[STATS].forget_engine)

    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(pipeline_ctx)
    app.cleanup_ctx.append(kv_events_ctx)
    app.cleanup_ctx.append(background_ctx)
    app.cleanup_ctx.append(tracing_ctx)
    if obs.metrics_listen:
        app.cleanup_ctx.append(metrics_listen_ctx)
    else:
        app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/admin/stats", stats_handler)
    app.router.add_get("/admin/capacity", admin_capacity)
    app.router.add_get("/dashboard", dashboard)
    for endpoint, path in PATHS.items():
        app.router.add_post(path, _inference(endpoint))
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    if cfg.gateway.batch.enabled:
        add_batch_routes(app)
    return app


def reload_engines(app: web.Application, new: EnginesConfig) -> None:
    """Apply a reloaded ``engines.yaml`` to the running app (:mod:`gateway.reload`):
    the supervisor adds, drains and retires engines; the director serves the new
    model list (a model no longer served answers 404 ``model_not_found``, and its
    queued requests get the same), scheduler plugins and saturation settings; the
    metrics label the new models. Each process applies it to its own pool; the
    supervisor of the process that owns the engines launches and stops them.

    Raises:
        ConfigError: the file fails the checks across files (a tenant's allowed
            model or a fallback model not served) or names a kind that cannot be
            launched; nothing changed.
    """
    director, supervisor = app[DIRECTOR], app[SUPERVISOR]
    tenants: TenantsConfig = app[TENANTS].cfg
    path = app[CONFIG].paths.get("engines")
    check_cross_refs(Config(engines=new, tenants=tenants, paths=app[CONFIG].paths))
    applied, pending = reloadable_engines(director.cfg.engines, new)
    try:
        added, removed = supervisor.reconfigure(applied.engines, app[CONFIG].gateway.drain_grace_s)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    director.set_engines(applied)
    app[METRICS].set_models(applied.model_names())
    log.info("engines reloaded: added %s, draining %s", added, removed)
    if pending:
        log.warning("%s: %s changed; these take effect on a restart", path, ", ".join(pending))


# --------------------------------------------------------------------------- cleanup_ctx


async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
    """The shared client session and the supervisor: engines launched (or probed) on
    start, drained and stopped on shutdown. A worker that does not own the engines
    follows the owner's address file instead of launching them."""
    cfg, worker = app[CONFIG], app[WORKER]
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        # answers are relayed and parsed as they arrive: ask engines (and any proxy in
        # front of them) for uncompressed bytes; aiohttp would otherwise offer gzip,
        # deflate (and br) on every request, probes and scrapes included
        headers={"Accept-Encoding": "identity"},
        auto_decompress=False,
    )
    app[SESSION] = session
    app[MODEL_CARDS] = ModelCards(session, STARTED, cfg.gateway.timeouts.connect_s)
    supervisor = Supervisor(cfg=cfg.engines, pool=app[POOL], session=session,
                            model_cache_dir=app[MODEL_CACHE_DIR], clock=app[CLOCK],
                            launch=worker is None or worker.owns_engines,
                            address_file=worker.address_file if worker else None)
    app[SUPERVISOR] = supervisor
    await supervisor.start()
    try:
        yield
    finally:
        await supervisor.stop(cfg.gateway.drain_grace_s)
        await session.close()


async def pipeline_ctx(app: web.Application) -> AsyncIterator[None]:
    """The request path: response cache and the director; every pool change wakes
    the admission queues. Closes the queues, cache and store."""
    cfg, pool, queues, store = app[CONFIG], app[POOL], app[QUEUES], app[STORE]
    # loading the embedding model takes seconds: keep it off the event loop
    cache = await asyncio.to_thread(open_cache, cfg.gateway.cache, clock=app[CLOCK]) \
        if cfg.gateway.cache.enabled else None
    app[DIRECTOR] = Director(
        cfg=cfg, pool=pool, scheduler=app[SCHEDULER],
        client=EngineClient(session=app[SESSION], timeouts=cfg.gateway.timeouts,
                            max_event_bytes=cfg.gateway.max_event_bytes, clock=app[CLOCK],
                            max_response_bytes=cfg.gateway.max_response_bytes),
        limiter=app[LIMITER], queues=queues,
        detector=SaturationDetector.from_config(cfg.engines), cache=cache,
        clock=app[CLOCK], spans=app[SPANS], gate=app[SLO_GATE], responses=ResponseStore(
            open_byte_store(cfg.gateway.cache, app[CLOCK])[0], cfg.gateway.cache.responses_ttl_s))

    def kick() -> None:
        for q in queues.values():
            q.kick()

    pool.listeners.append(kick)
    pool.on_add.append(app[DIRECTOR].engine_added)
    pool.on_remove.append(app[DIRECTOR].engine_removed)
    try:
        yield
    finally:
        pool.on_add.remove(app[DIRECTOR].engine_added)
        pool.on_remove.remove(app[DIRECTOR].engine_removed)
        pool.listeners.remove(kick)
        for q in queues.values():
            q.close()
        if cache is not None:
            await cache.close()
        await app[DIRECTOR].responses.close()
        await store.close()


async def kv_events_ctx(app: web.Application) -> AsyncIterator[None]:
    """With ``scheduler.prefix.source: events``, one KV-event subscriber per engine
    that publishes, feeding this process's prefix index (every gateway process
    follows the engines itself); their state on ``/metrics``."""
    index = app[SCHEDULER].index
    if not isinstance(index, EventPrefixIndex):
        yield
        return
    pool = app[POOL]
    subscribers = KVEventSubscribers(index)
    subscribers.follow(pool.engines)

    def follow(engine: Engine) -> None:
        subscribers.follow([engine])

    pool.on_add.append(follow)
    pool.on_remove.append(subscribers.unfollow)
    app[METRICS].registry.register(subscribers)
    yield
    app[METRICS].registry.unregister(subscribers)
    pool.on_add.remove(follow)
    pool.on_remove.remove(subscribers.unfollow)
    await subscribers.stop()


async def background_ctx(app: web.Application) -> AsyncIterator[None]:
    """The dashboard's stats sampler and, with a tenants file, its hot reloader."""
    tasks = [asyncio.create_task(app[STATS].run())]
    reloader = app[RELOADER]
    if reloader is not None:
        tasks.append(asyncio.create_task(reloader.run()))
    yield
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """Flushes and shuts down the span exporter on shutdown."""
    yield
    provider = app[TRACER_PROVIDER]
    if provider is not None:
        provider.shutdown()


async def metrics_listen_ctx(app: web.Application) -> AsyncIterator[None]:
    """``/metrics`` on its own listener (``observability.metrics_listen``); under
    ``--workers N``, worker i listens on that port + i (each worker's metrics are its
    own)."""
    host, _, port = (app[CONFIG].gateway.observability.metrics_listen or "").rpartition(":")
    worker = app[WORKER]
    runner = web.AppRunner(metrics_app(app[METRICS]), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host or "127.0.0.1",
                      int(port) + (worker.index if worker else 0)).start()
    yield
    await runner.cleanup()
