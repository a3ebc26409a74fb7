"""``scheduler.prefix.source: events`` end to end with launched simulated engines:
the gateway gives each engine ``--kv-events-config`` with private ``ipc://`` sockets, follows its
events, and a repeated prompt is scored from what the engine reported stored — the
prediction in ``x-sluice-prefix-tokens`` equals the engine's ``cached_tokens``. A
restarted engine's entries are cleared and rebuilt from the new process."""

from __future__ import annotations

import json
from typing import Any

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from gateway.app import SUPERVISOR
from gateway.keys import SCHEDULER
from loadtest.workloads.base import synthetic_text
from tests.integration.conftest import FAST_SUPERVISOR, run_gateway
from tests.support import wait_for

MODEL = "sim-model"
SIM_ARGS = ["--profile", "h200-llama3-8b", "--num-blocks", "2048", "--max-model-len", "8192",
            "--enable-prompt-tokens-details"]


def events_config(source: str = "events", cache_salt: bool = True) -> Config:
    return Config(
        gateway=GatewayConfig.model_validate({"port": 0, "cache": {"enabled": False}}),
        engines=EnginesConfig.model_validate({
            "engines": [{"name": "sim", "model": MODEL, "kind": "sim", "replicas": 2,
                         "args": SIM_ARGS}],
            "supervisor": {**FAST_SUPERVISOR, "startup_grace_s": 60},
            "scheduler": {"scorers": [{"type": "prefix-affinity"}],
                          "prefix": {"source": source, "cache_salt": cache_salt}}}),
        tenants=TenantsConfig.model_validate({"allow_anonymous": True}),
    )



async def ask(gw, text: str) -> tuple[str, dict[str, int], dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    r = await gw.post("/v1/chat/completions", body)
    assert r.status == 200, await r.text()
    usage = (await r.json())["usage"]
    pairs = (p.split("=") for p in r.headers["x-sluice-prefix-tokens"].split(", "))
    return r.headers["x-sluice-engine"], {k: int(v) for k, v in pairs}, usage


async def test_repeated_prompt_is_scored_from_engine_events() -> None:
    async with run_gateway(events_config()) as gw:
        sup = gw.app[SUPERVISOR]
        for runner in sup.runners:  # the flag, with an endpoint per engine
            argv = runner.process.argv
            flag = json.loads(argv[argv.index("--kv-events-config") + 1])
            assert flag["enable_kv_cache_events"] and flag["endpoint"].startswith("ipc://")
            assert runner.engine.kv_events.replay == flag["replay_endpoint"]
        index = gw.app[SCHEDULER].index
        await wait_for(lambda: all(index.synced(e) for e in gw.pool.engines), 10)
        text = synthetic_text("kv-events", 3000)
        first, predicted, usage = await ask(gw, text)
        assert predicted == {"events": 0, "approximate": 0}
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        engine = gw.pool.get(first)
        await wait_for(lambda: index.entries(first) > 0, 10)  # the engine reported it stored
        index.predicted.forget(first)  # score from the engine's report alone
        second, predicted, usage = await ask(gw, text)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert second == first and cached > 2000
        assert predicted["events"] == cached
        async with gw.session.get(gw.url + "/metrics") as r:
            exposition = await r.text()
        assert f'sluice_engine_kv_events_synced{{engine="{first}",model="{MODEL}"}} 1.0' \
            in exposition
        assert f'sluice_engine_kv_events_batches_total{{engine="{first}",model="{MODEL}"}}' \
            in exposition
        # the engine restarts (a new process, an empty cache): entries cleared, rebuilt
        runner = next(r for r in sup.runners if r.engine is engine)
        generation = engine.generation
        runner.process.kill()
        await wait_for(lambda: engine.generation > generation and engine.routable, 30)
        await wait_for(lambda: index.synced(engine), 10)
        assert index.entries(first) == 0
        _, predicted, usage = await ask(gw, text)  # no engine holds it now
        assert predicted["events"] == usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_approximate_source_sends_no_flag() -> None:
    async with run_gateway(events_config("approximate")) as gw:
        for runner in gw.app[SUPERVISOR].runners:
            assert "--kv-events-config" not in runner.process.argv
            assert runner.engine.kv_events is None
        _, predicted, _ = await ask(gw, synthetic_text("approx", 100))
        assert set(predicted) == {"approximate"}


async def test_requests_that_reached_an_engine_another_way_are_seen() -> None:
    """The routing history cannot know what an engine computed for someone else; its
    events do. Each engine gets a different prompt directly (not through the
    gateway); the gateway then sends each prompt to the engine that holds it."""
    async with run_gateway(events_config(cache_salt=False)) as gw:
        index = gw.app[SCHEDULER].index
        await wait_for(lambda: all(index.synced(e) for e in gw.pool.engines), 10)
        texts = {e.id: synthetic_text(f"direct-{e.id}", 2000) for e in gw.pool.engines}
        for engine in gw.pool.engines:
            body = {"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": texts[engine.id]}]}
            async with gw.session.post(engine.base_url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            await wait_for(lambda e=engine: index.entries(e.id) > 0, 10)
        for engine in gw.pool.engines:
            chosen, predicted, usage = await ask(gw, texts[engine.id])
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert chosen == engine.id and cached > 1500
            assert predicted == {"events": cached, "approximate": 0}
