"""Prefix-affinity routing through the gateway in front of 2 simulated engines
(``kind: sim``, launched by the supervisor): affinity, spreading under load, dead and
draining engines, one shared system prompt, per-tenant prefix-cache isolation."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from engines.pool import EngineState
from gateway.auth import hash_key
from gateway.keys import SUPERVISOR
from loadtest.workloads.base import synthetic_text
from tests.integration.conftest import FAST_SUPERVISOR, run_gateway
from tests.support import wait_for

MODEL = "sim-model"
#: fast simulated H200 engines; a small KV pool so start-up stays ~1 s
SIM_ARGS = ["--profile", "h200-llama3-8b", "--num-blocks", "2048", "--max-model-len", "8192"]
SHIPPED = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "engines.yaml")
                         .read_text())["scheduler"]


def sim_config(tenants: dict[str, Any] | None = None) -> Config:
    specs = [{"name": "sim", "model": MODEL, "kind": "sim", "replicas": 2, "args": SIM_ARGS}]
    return Config(
        gateway=GatewayConfig.model_validate(
            # the bursts here test where requests land, not SLO shedding: a queued
            # ticket may wait as long as the queue allows
            {"port": 0, "cache": {"enabled": False}, "queue": {"default_max_wait_s": 30},
             "slo": {"standard": {"ttft_s": 30, "tpot_s": 0.1}}}),
        engines=EnginesConfig.model_validate({
            "engines": specs, "supervisor": {**FAST_SUPERVISOR, "startup_grace_s": 60},
            "scheduler": SHIPPED, "saturation": {"max_waiting": 64}}),
        tenants=TenantsConfig.model_validate(tenants or {"allow_anonymous": True}),
    )


def chat(user: str, system: str | None = None, max_tokens: int = 4) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


async def send(gw, body: dict[str, Any], **headers: str) -> str:
    r = await gw.post("/v1/chat/completions", body, headers=headers)
    assert r.status == 200, await r.text()
    await r.read()
    return r.headers["x-sluice-engine"]


async def wait_metrics(gw) -> None:
    await wait_for(lambda: all(e.metrics is not None and e.block_size for e in gw.pool.engines),
                   what="every engine's metrics")


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


async def total_hits(gw) -> float:
    return sum([(await scrape(e.base_url)).get("vllm:prefix_cache_hits_total", 0.0)
                for e in gw.pool.engines])


async def test_repeated_prefixes_land_on_the_same_engine() -> None:
    async with run_gateway(sim_config()) as gw:
        await wait_metrics(gw)
        placed: dict[int, set[str]] = {}
        for turn in range(3):
            for conv in range(6):
                body = chat(synthetic_text(f"conv{conv}", 400) + f" turn {turn}")
                placed.setdefault(conv, set()).add(await send(gw, body))
        assert all(len(engines) == 1 for engines in placed.values()), placed
        assert len(set().union(*placed.values())) == 2  # new conversations spread
        hits = await total_hits(gw)
        assert hits >= 6 * 2 * 384  # turns 2 and 3 reuse ≥ 384 cached tokens each


async def test_far_more_loaded_engine_makes_traffic_spread() -> None:
    async with run_gateway(sim_config()) as gw:
        await wait_metrics(gw)
        prefix = synthetic_text("hot", 600)
        home = await send(gw, chat(prefix + " first"))
        busy = next(e for e in gw.pool.engines if e.id == home)
        # another client (say a second gateway replica) loads that engine directly
        async with aiohttp.ClientSession() as s:
            async def direct(i: int) -> None:
                async with s.post(busy.base_url + "/v1/chat/completions",
                                  json=chat(f"other {i}", max_tokens=600)) as r:
                    await r.read()
            background = [asyncio.create_task(direct(i)) for i in range(12)]
            await wait_for(lambda: busy.metrics.num_running >= 12,
                           what="the gateway's metrics to show the load")
            placed = Counter([await send(gw, chat(prefix + f" q{i}")) for i in range(8)])
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        assert placed[home] <= 1, placed  # affinity yielded to load


async def test_dead_or_draining_engine_is_never_picked() -> None:
    async with run_gateway(sim_config()) as gw:
        await wait_metrics(gw)
        prompts = [synthetic_text(f"p{i}", 300) for i in range(6)]
        homes = {p: await send(gw, chat(p)) for p in prompts}
        a, b = gw.pool.engines
        gw.pool.set_state(b, EngineState.DRAINING)
        assert {await send(gw, chat(p + " again")) for p in prompts} == {a.id}
        gw.pool.set_state(b, EngineState.READY)
        runner = next(r for r in gw.app[SUPERVISOR].runners if r.engine is a)
        runner.process.kill()  # dead: the supervisor notices and stops routing to it
        await wait_for(lambda: a.state is not EngineState.READY, 10, "the supervisor to notice")
        assert {await send(gw, chat(p + " third")) for p in prompts} == {b.id}
        assert set(homes.values()) == {a.id, b.id}


async def test_shared_system_prompt_does_not_pile_on_one_engine() -> None:
    async with run_gateway(sim_config()) as gw:
        await wait_metrics(gw)
        system = synthetic_text("system", 1500)
        bodies = [chat(f"question {i}: " + synthetic_text(f"u{i}", 60), system=system,
                       max_tokens=150) for i in range(24)]
        placed = Counter(await asyncio.gather(*(send(gw, b) for b in bodies)))
        assert len(placed) == 2 and min(placed.values()) >= 6, placed
        # later, one at a time: both engines hold the prompt, load decides
        more = Counter([await send(gw, chat(f"late {i}", system=system)) for i in range(10)])
        assert len(more) == 2, more


async def test_tenants_do_not_share_the_engine_prefix_cache() -> None:
    tenants = {"tenants": [{"name": "acme", "api_key_hashes": [hash_key("sk-acme")]},
                           {"name": "beta", "api_key_hashes": [hash_key("sk-beta")]},
                           {"name": "gamma", "api_key_hashes": [hash_key("sk-gamma")],
                            "cache_namespace": "shared"},
                           {"name": "delta", "api_key_hashes": [hash_key("sk-delta")],
                            "cache_namespace": "shared"}]}
    async with run_gateway(sim_config(tenants)) as gw:
        await wait_metrics(gw)
        body = chat(synthetic_text("secret", 800))

        async def hits_after(key: str) -> float:
            before = await total_hits(gw)
            await send(gw, body, Authorization=f"Bearer {key}")
            return await total_hits(gw) - before

        assert await hits_after("sk-acme") == 0
        assert await hits_after("sk-acme") >= 768  # same tenant: its own cache
        assert await hits_after("sk-beta") == 0  # identical prompt, other tenant
        assert await hits_after("sk-beta") >= 768
        assert await hits_after("sk-gamma") == 0
        assert await hits_after("sk-delta") >= 768  # a shared namespace shares


@pytest.mark.parametrize("header", ["conv-42"])
async def test_session_header_sticks_short_prompts(header: str) -> None:
    async with run_gateway(sim_config()) as gw:
        await wait_metrics(gw)
        first = await send(gw, chat("hi"), **{"x-session-id": header})
        placed = {await send(gw, chat(f"short {i}"), **{"x-session-id": header})
                  for i in range(6)}
        assert placed == {first}
