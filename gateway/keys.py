"""Every typed key of the gateway: the shared objects an app holds (built by
``create_app`` or in its ``cleanup_ctx`` functions; no module-level singletons) and
the per-request values."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from config.schema import Config, TenantQuota
from engines.pool import EnginePool
from engines.scheduler import Scheduler
from engines.supervisor import Supervisor
from gateway.auth import TenantDirectory
from gateway.metrics import GatewayMetrics
from gateway.models import ModelCards
from gateway.record import Observer, RequestRecord
from gateway.reload import ConfigReloader
from gateway.stats import StatsFeed
from gateway.tracing import Spans
from gateway.workers import WorkerRole
from limits.admission import AdmissionQueue
from limits.interfaces import Clock, CounterStore
from limits.rate_limit import RateLimiter
from limits.slo_gate import SloGate

if TYPE_CHECKING:  # the director and the batch runner's pipeline read the keys below
    from gateway.batch_runner import BatchRunner
    from gateway.director import Director
    from gateway.placement import Placement

CONFIG = web.AppKey("config", Config)
TENANTS = web.AppKey("tenants", TenantDirectory)
POOL = web.AppKey("pool", EnginePool)
SCHEDULER = web.AppKey("scheduler", Scheduler)
#: the admission queue of each served model
QUEUES: web.AppKey[dict[str, AdmissionQueue[Placement]]] = web.AppKey("queues")
STORE = web.AppKey("store", CounterStore)
LIMITER = web.AppKey("limiter", RateLimiter)
SLO_GATE = web.AppKey("slo_gate", SloGate)
#: the one clock of the request path, the engines and the limits
CLOCK = web.AppKey("clock", Clock)
METRICS = web.AppKey("metrics", GatewayMetrics)
STATS = web.AppKey("stats", StatsFeed)
OBSERVERS = web.AppKey("observers", list[Observer])  # called with each finished record
SPANS = web.AppKey("spans", Spans)
#: the span exporter's provider, shut down with the app (None: tracing off)
TRACER_PROVIDER = web.AppKey("tracer_provider", TracerProvider | None)
#: where ``packaged:`` models are prepared (None: the default folder)
MODEL_CACHE_DIR = web.AppKey("model_cache_dir", Path | None)
#: this process's place under ``sluice serve --workers N`` (None: the only process)
WORKER = web.AppKey("worker", WorkerRole | None)
#: None when no configuration file is watched (no paths in the config)
RELOADER = web.AppKey("reloader", ConfigReloader | None)
# created once the app starts (in its cleanup_ctx)
SESSION = web.AppKey("session", aiohttp.ClientSession)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
DIRECTOR: web.AppKey[Director] = web.AppKey("director")
#: this process's Batch API runner and its job store (with ``batch.enabled``)
RUNNER: web.AppKey[BatchRunner] = web.AppKey("batch_runner")
#: ``/v1/models`` entries as the engines describe their models
MODEL_CARDS = web.AppKey("model_cards", ModelCards)

# per-request keys
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", TenantQuota)
RECORD = web.RequestKey("record", RequestRecord)
