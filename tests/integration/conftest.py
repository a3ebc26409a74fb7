"""A gateway on a real loopback port in front of :class:`FakeEngine` s."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from gateway.app import create_app
from gateway.errors import GatewayRunner
from gateway.keys import DIRECTOR, OBSERVERS, POOL
from gateway.record import RequestRecord
from tests.conftest import free_port
from tests.integration.fake_engine import FakeEngine
from tests.support import wait_for

FAST_SUPERVISOR = {"probe_interval_s": 0.1, "probe_timeout_s": 1.0, "failure_threshold": 2,
                   "metrics_interval_s": 0.2, "restart_backoff_s": 0.1,
                   "inference_probe_idle_s": 3600}


def make_config(engines: list[FakeEngine], *, gateway: dict[str, Any] | None = None,
                tenants: dict[str, Any] | None = None,
                models: list[str] | None = None) -> Config:
    specs = [{"name": f"e{i}", "model": e.model, "kind": "external", "url": e.url}
             for i, e in enumerate(engines)]
    for j, m in enumerate(models or []):  # configured models with no live engine
        specs.append({"name": f"ghost{j}", "model": m, "kind": "external",
                      "url": f"http://127.0.0.1:{free_port()}"})
    gateway = {"port": 0, **(gateway or {})}
    gateway.setdefault("cache", {"semantic": {"enabled": False}})  # no model load per test
    return Config(
        gateway=GatewayConfig.model_validate(gateway),
        engines=EnginesConfig.model_validate({"engines": specs, "supervisor": FAST_SUPERVISOR}),
        tenants=TenantsConfig.model_validate(tenants or {"allow_anonymous": True}),
    )


class Gateway:
    """A running gateway app and a client session to it. ``sent`` counts the requests
    made with :meth:`post`, ``finished`` the requests whose record reached the
    observers (the gateway is done with them)."""

    def __init__(self, app: web.Application, url: str, session: aiohttp.ClientSession) -> None:
        self.app, self.url, self.session = app, url, session
        self.sent = self.finished = 0
        app[OBSERVERS].append(self._finished)

    def _finished(self, rec: RequestRecord) -> None:
        self.finished += 1

    @property
    def pool(self):
        return self.app[POOL]

    async def post(self, path: str, body: Any = None, **kw: Any) -> aiohttp.ClientResponse:
        if body is not None and "data" not in kw:
            kw["json"] = body
        self.sent += 1
        return await self.session.post(self.url + path, **kw)

    async def wait_ready(self, n: int, timeout_s: float = 10.0) -> None:
        await wait_for(lambda: sum(e.routable for e in self.pool.engines) >= n, timeout_s,
                       f"{n} routable engines")

    async def idle(self) -> None:
        """Wait until the gateway finished every request :meth:`post` sent and every
        answer it stores in the cache off the response path."""
        director = self.app[DIRECTOR]
        stores = director.cache._background if director.cache is not None else set()
        await wait_for(lambda: self.finished >= self.sent and not stores,
                       what="the gateway to finish its requests and cache stores")


@asynccontextmanager
async def run_gateway(cfg: Config, ready: int | None = None,
                      app: web.Application | None = None) -> AsyncIterator[Gateway]:
    app = app if app is not None else create_app(cfg)
    runner = GatewayRunner(app, handler_cancellation=True, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession() as session:
        gw = Gateway(app, f"http://127.0.0.1:{port}", session)
        await gw.wait_ready(len(cfg.engines.engines) if ready is None else ready)
        try:
            yield gw
        finally:
            await runner.cleanup()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def make(n: int = 1, **kw: Any) -> list[FakeEngine]:
        out = [await FakeEngine(**kw).start() for _ in range(n)]
        started.extend(out)
        return out

    yield make
    for e in started:
        await e.stop()
