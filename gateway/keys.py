"""Typed keys of the shared objects an app holds (created and closed in
``cleanup_ctx``; no module-level singletons)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from config.schema import Config, TenantQuota
from engines.pool import EnginePool
from gateway.auth import TenantDirectory
from gateway.record import Observer, RequestRecord
from gateway.tracing import Spans

CONFIG = web.AppKey("config", Config)
TENANTS = web.AppKey("tenants", TenantDirectory)
POOL = web.AppKey("pool", EnginePool)
SESSION = web.AppKey("session", aiohttp.ClientSession)
OBSERVERS = web.AppKey("observers", list[Observer])  # called with each finished record
SPANS = web.AppKey("spans", Spans)

# per-request keys
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", TenantQuota)
RECORD = web.RequestKey("record", RequestRecord)
