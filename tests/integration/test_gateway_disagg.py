"""Prefill–decode disaggregation through the gateway over real loopback HTTP, in
front of simulated engines with KV connectors (and fake engines for failures):
both legs field by field as vLLM's proxy sends them, one request id, accounting
charged once, failures on each leg, client disconnect during each leg, a prompt
cached on a decode engine that skips the prefill leg, and the prefills held at the
gateway (prefill legs, and local prompts beyond a busy decode engine's step
budget)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from gateway.disagg import PREFILL_PARAMS
from gateway.keys import DIRECTOR
from loadtest.sim_engine import SimEngine, get_profile
from loadtest.sim_engine.disagg import SimConnector
from loadtest.sim_engine.server import create_app
from tests.conftest import free_port
from tests.integration.conftest import FAST_SUPERVISOR, run_gateway
from tests.integration.fake_engine import FakeEngine
from tests.support import wait_for

MODEL = "sim-pd"
PROFILE = get_profile("cpu-gemma3-270m-quiet")
LONG = " ".join(f"word{i} of a long prompt" for i in range(300))  # ~1,500 tokens
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 4,
        "stream": True}


class Sim:
    """An in-process simulated engine that records the bodies and headers it got."""

    def __init__(self, role: str, speed: float) -> None:
        self.engine = SimEngine(PROFILE, MODEL, speed=speed)
        self.connector = SimConnector(self.engine, role)
        self.received: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connector.host, self.connector.port = "127.0.0.1", self.port

    @web.middleware
    async def _record(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.path.startswith("/v1/") and request.method == "POST":
            self.received.append(json.loads(await request.read()))
            self.request_ids.append(request.headers.get("X-Request-Id"))
        return await handler(request)

    async def start(self) -> web.AppRunner:
        app = create_app(self.engine, self.connector)
        app.middlewares.append(self._record)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


def spec(name: str, url: str, role: str) -> dict[str, Any]:
    return {"name": name, "model": MODEL, "kind": "external", "url": url, "role": role,
            "kv_connector": "NixlConnector"}


@asynccontextmanager
async def fleet(roles: list[str], *, speed: float = 50.0, fakes: dict[str, str] | None = None,
                disaggregation: dict[str, Any] | None = None,
                tenants: dict[str, Any] | None = None) -> AsyncIterator[tuple]:
    """Sims with ``roles`` (plus fake engines: name → role, answering 500) behind a
    gateway; yields (gateway, sims, fakes)."""
    async with AsyncExitStack() as stack:
        sims, specs = [], []
        for i, r in enumerate(roles):
            sim = Sim(r, speed)
            runner = await sim.start()
            stack.push_async_callback(runner.cleanup)
            sims.append(sim)
            specs.append(spec(f"{r}{i}", sim.url, r))
        fake_engines = {}
        for name, r in (fakes or {}).items():
            fake = await FakeEngine(model=MODEL, mode="error500").start()
            stack.push_async_callback(fake.stop)
            fake_engines[name] = fake
            specs.insert(0, spec(name, fake.url, r))  # placed first: chosen on ties
        cfg = Config(
            gateway=GatewayConfig.model_validate({"port": 0, "cache": {"enabled": False},
                                                  "retry_attempts": 2}),
            engines=EnginesConfig.model_validate({
                "engines": specs, "supervisor": FAST_SUPERVISOR,
                "disaggregation": disaggregation or {"policy": "threshold",
                                                     "threshold_tokens": 256}}),
            tenants=TenantsConfig.model_validate(tenants or {"allow_anonymous": True}))
        gw = await stack.enter_async_context(run_gateway(cfg))
        await gw.wait_ready(len(specs))
        await wait_for(lambda: all(e.metrics is not None for e in gw.pool.engines), 10)
        yield gw, sims, fake_engines



async def gateway_metrics(gw) -> dict[tuple[str, tuple], float]:
    async with gw.session.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def idle(gw) -> bool:
    return all(e.in_flight == 0 and e.promised_blocks == 0 for e in gw.pool.engines)


async def test_split_request_follows_vllm_protocol_field_by_field():
    async with fleet(["prefill", "decode"]) as (gw, (p, d), _):
        body = {**CHAT, "stream_options": {"include_usage": True}, "min_tokens": 2,
                "temperature": 0.5}
        async with await gw.post("/v1/chat/completions", body) as r:
            assert r.status == 200
            raw = await r.read()
            rid = r.headers["x-request-id"]
            assert r.headers["x-sluice-engine"] == "decode1"
            assert r.headers["x-sluice-prefill-engine"] == "prefill0"
        assert raw.endswith(b"data: [DONE]\n\n")
        [pbody], [dbody] = p.received, d.received
        # prefill leg: as vLLM's proxy, no stream, one token, no min_tokens
        assert pbody == {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 1,
                         "stream": False, "temperature": 0.5,
                         "kv_transfer_params": dict(PREFILL_PARAMS)}
        # decode leg: the client's body plus the prefill engine's kv_transfer_params
        params = dbody.pop("kv_transfer_params")
        assert dbody == body
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == p.connector.engine_id
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
        assert params["remote_request_id"].startswith(f"chatcmpl-{rid}-")
        # one request id on both legs
        assert p.request_ids == d.request_ids == [rid]
        # the decode engine read the blocks; the prefill engine freed them
        assert d.engine.scheduler.counters.external_prefix_cache_hits > 0
        assert p.connector.held_requests == 0
        await wait_for(lambda: idle(gw), 10)


async def test_accounting_is_charged_once():
    async with fleet(["prefill", "decode"]) as (gw, (p, d), _):
        async with await gw.post("/v1/chat/completions",
                                 {**CHAT, "stream_options": {"include_usage": True}}) as r:
            usage = [json.loads(line[6:]) for line in (await r.read()).split(b"\n\n")
                     if line.startswith(b"data: {")][-1]["usage"]
        m = await gateway_metrics(gw)
        tokens = {dict(k[1])["kind"]: v for k, v in m.items() if k[0] == "sluice_tokens_total"}
        assert tokens == {"prompt": usage["prompt_tokens"], "completion": 4}
        requests = sum(v for k, v in m.items() if k[0] == "sluice_requests_total")
        assert requests == 1
        assert len(p.received) == len(d.received) == 1


async def test_prefill_failure_retries_on_another_prefill_engine():
    async with fleet(["prefill", "decode"], fakes={"bad": "prefill"}) as (gw, (p, d), fakes):
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert r.status == 200
            await r.read()
            assert r.headers["x-sluice-prefill-engine"] == "prefill0"
        assert len(fakes["bad"].received) == 1 and len(p.received) == 1
        assert "kv_transfer_params" in d.received[0]
        await wait_for(lambda: idle(gw), 10)


async def test_every_prefill_failing_leaves_the_prefill_to_the_decode_engine():
    async with fleet(["decode"], fakes={"bad": "prefill"}) as (gw, (d,), fakes):
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
            assert "x-sluice-prefill-engine" not in r.headers
        assert len(fakes["bad"].received) == 1
        assert "kv_transfer_params" not in d.received[0]
        assert d.engine.scheduler.counters.external_prefix_cache_hits == 0
        await wait_for(lambda: idle(gw), 10)


async def test_decode_failure_before_first_byte_retries_on_another_decode_engine():
    async with fleet(["prefill", "decode"], fakes={"bad": "decode"}) as (gw, (p, d), fakes):
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
            assert r.headers["x-sluice-engine"] == "decode1"
        assert len(fakes["bad"].received) == 1
        params = fakes["bad"].received[0]["kv_transfer_params"]
        assert d.received[0]["kv_transfer_params"] == params  # the same blocks
        assert d.engine.scheduler.counters.external_prefix_cache_hits > 0
        await wait_for(lambda: idle(gw), 10)


async def test_disconnect_during_prefill_leg_aborts_it():
    async with fleet(["prefill", "decode"], speed=2.0) as (gw, (p, d), _):
        task = asyncio.create_task(gw.post("/v1/chat/completions", CHAT))
        await wait_for(lambda: p.engine.scheduler.has_work, 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: not p.engine.scheduler.has_work, 10)
        await wait_for(lambda: idle(gw), 10)
        assert p.connector.held_requests == 0
        assert p.engine.kv.num_free_blocks == PROFILE.num_blocks - 1
        assert d.received == []


async def test_disconnect_during_decode_leg_aborts_it():
    async with fleet(["prefill", "decode"], speed=2.0) as (gw, (p, d), _):
        r = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 100})
        assert r.status == 200
        await r.content.readuntil(b"\n\n")  # streaming from the decode engine
        assert d.engine.scheduler.has_work
        r.close()
        await wait_for(lambda: not d.engine.scheduler.has_work, 10)
        await wait_for(lambda: idle(gw), 10)
        assert d.engine.kv.usage == 0.0  # every block freed
        assert len(p.received) == len(d.received) == 1


async def test_prompt_cached_on_a_decode_engine_skips_the_prefill_leg():
    policy = {"policy": "predicted", "max_decode_stall_ms": 100}
    async with fleet(["prefill", "decode"], speed=5.0, disaggregation=policy) as (gw, (p, d), _):
        # a long-running stream keeps the decode engine busy: a long local prefill
        # would stall it past the budget
        busy = await gw.post("/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1000, "stream": True})
        await busy.content.readuntil(b"\n\n")
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert r.headers.get("x-sluice-prefill-engine") == "prefill0"  # split
            await r.read()
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert "x-sluice-prefill-engine" not in r.headers  # cached on decode1: local
            assert r.headers["x-sluice-engine"] == "decode1"
            await r.read()
        assert len(p.received) == 1
        assert len(d.received) == 3 and "kv_transfer_params" not in d.received[2]
        busy.close()
        await wait_for(lambda: idle(gw), 10)


async def test_a_multi_sequence_request_is_not_split():
    async with fleet(["prefill", "decode"]) as (gw, (p, d), _):
        async with await gw.post("/v1/chat/completions", {**CHAT, "n": 2}) as r:
            assert r.status == 200
            await r.read()
            assert "x-sluice-prefill-engine" not in r.headers
        assert p.received == [] and len(d.received) == 1


async def test_prefill_legs_held_at_the_gateway_go_shortest_first():
    """Beyond ``prefill_hold_tokens`` outstanding on the prefill engine, legs wait at
    the gateway and leave shortest first (first come, first served would send the
    long one that arrived first)."""
    longer = " ".join(f"item{i} in another long prompt" for i in range(250))  # ~1,500 tokens
    short = " ".join(f"word{i} of a prompt" for i in range(60))  # ~300 tokens
    async with fleet(["prefill", "decode"], speed=5.0,
                     disaggregation={"policy": "threshold", "threshold_tokens": 256,
                                     "prefill_hold_tokens": 1}) as (gw, (p, d), _):
        queue = gw.app[DIRECTOR].placer.disagg.queue

        def held() -> int:
            return sum(len(legs) for legs in queue.held.values())

        async def ask(text: str) -> int:
            body = {**CHAT, "messages": [{"role": "user", "content": text}]}
            async with await gw.post("/v1/chat/completions", body) as r:
                await r.read()
                return r.status

        first = asyncio.create_task(ask(LONG))
        await wait_for(lambda: len(p.received) == 1)  # computing on the prefill engine
        behind = [asyncio.create_task(ask(longer))]
        await wait_for(lambda: held() == 1)
        behind.append(asyncio.create_task(ask(short)))
        await wait_for(lambda: held() == 2)
        m = await gateway_metrics(gw)
        assert m[("sluice_prefill_legs_held",
                  (("engine", "prefill0"), ("model", MODEL)))] == 2
        assert await asyncio.gather(first, *behind) == [200, 200, 200]
        order = [b["messages"][0]["content"] for b in p.received]
        assert order == [LONG, short, longer]
        await wait_for(lambda: idle(gw), 10)


async def test_a_held_leg_past_its_latest_start_is_shed_with_an_openai_error():
    """With adaptive admission, a leg still held at the gateway when its TTFT target
    can no longer be met is answered 503 ``predicted_miss`` with ``Retry-After``; the
    request computing ahead of it is served."""
    other = " ".join(f"item{i} in another long prompt" for i in range(250))
    async with fleet(["prefill", "decode"], speed=0.5,
                     disaggregation={"policy": "threshold", "threshold_tokens": 256,
                                     "prefill_hold_tokens": 1}) as (gw, (p, d), _):
        disagg = gw.app[DIRECTOR].placer.disagg
        # observed speeds that predict both legs in time (the simulated prefill of
        # ~1,500 tokens takes ~3.6 s at speed 0.5, past the 2 s standard target)
        disagg.speed.s_per_token.update({e.id: 1e-5 for e in gw.pool.engines})

        async def ask(text: str):
            body = {**CHAT, "messages": [{"role": "user", "content": text}]}
            async with await gw.post("/v1/chat/completions", body) as r:
                return r.status, r.headers.get("Retry-After"), await r.read()

        first = asyncio.create_task(ask(LONG))
        await wait_for(lambda: len(p.received) == 1)
        behind = asyncio.create_task(ask(other))
        await wait_for(lambda: sum(len(v) for v in disagg.queue.held.values()) == 1)
        status, _, _ = await first
        assert status == 200
        status, retry_after, raw = await behind
        assert status == 503 and retry_after is not None and float(retry_after) > 0
        error = json.loads(raw)["error"]
        assert error["code"] == "overloaded" and "TTFT target" in error["message"]
        assert len(p.received) == 1  # the shed leg never reached the engine
        m = await gateway_metrics(gw)
        shed = {dict(k[1]).get("reason"): v for k, v in m.items()
                if k[0] == "sluice_rejected_total"}
        assert shed == {"overloaded:predicted_miss": 1}
        await wait_for(lambda: idle(gw), 10)


async def test_a_busy_decode_engine_takes_local_prompts_within_its_step_budget():
    """``predicted`` policy, a decode engine streaming: a prompt that fits its step
    budget runs there; a second one that does not fit beside the first's prefill
    waits at the gateway until that prefill ends; a prompt longer than the budget is
    split."""
    first = " ".join(f"alpha{i} of a prompt" for i in range(120))  # ~600 tokens
    second = " ".join(f"beta{i} of a prompt" for i in range(120))
    async with fleet(["prefill", "decode"], speed=2.0,
                     disaggregation={"policy": "predicted", "max_decode_stall_ms": 100},
                     ) as (gw, (p, d), _):
        disagg = gw.app[DIRECTOR].placer.disagg
        (decode,) = [e for e in gw.pool.engines if e.id == "decode1"]
        # 100 ms of stall at the prior 100 µs per prefill token: 1,000 tokens a step
        assert disagg.step_tokens(decode) == 1000
        # a prefill engine observed to be slow: every split is predicted later
        disagg.speed.s_per_token["prefill0"] = 1.0
        busy = await gw.post("/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1000, "stream": True})
        await busy.content.readuntil(b"\n\n")

        async def ask(text: str) -> tuple[int, str | None]:
            body = {**CHAT, "messages": [{"role": "user", "content": text}]}
            async with await gw.post("/v1/chat/completions", body) as r:
                await r.read()
                return r.status, r.headers.get("x-sluice-prefill-engine")

        a = asyncio.create_task(ask(first))
        await wait_for(lambda: len(d.received) == 2)  # sent at once: nothing outstanding
        b = asyncio.create_task(ask(second))
        await wait_for(lambda: len(disagg.queue.held.get("decode1", ())) == 1)
        m = await gateway_metrics(gw)
        assert m[("sluice_prefill_legs_held", (("engine", "decode1"), ("model", MODEL)))] == 1
        assert len(d.received) == 2  # held while the first prompt's prefill runs
        assert await asyncio.gather(a, b) == [(200, None), (200, None)]  # both local
        assert [x["messages"][0]["content"] for x in d.received[1:]] == [first, second]
        assert p.received == []
        status, prefill = await ask(LONG)  # longer than the budget: split
        assert (status, prefill) == (200, "prefill0") and len(p.received) == 1
        busy.close()
        await wait_for(lambda: idle(gw), 10)
