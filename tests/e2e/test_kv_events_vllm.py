"""The real CPU vLLM engine publishes KV-cache events to the gateway: with the
shipped ``engines.yaml`` (``scheduler.prefix.source: events``) the supervisor adds
``--kv-events-config``, the gateway's subscriber receives ``BlockStored`` for a long
prompt, and the repeated prompt is scored from those events — equal to what vLLM
reports cached (``--enable-prompt-tokens-details`` added here to see it).

Slow: one engine start (~60 s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from gateway.keys import SCHEDULER
from loadtest.workloads.base import synthetic_text
from tests.integration.conftest import run_gateway
from tests.support import wait_for

pytestmark = pytest.mark.slow
SHIPPED = Path(__file__).resolve().parents[2] / "config" / "engines.yaml"


def config() -> Config:
    raw = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    assert raw["scheduler"]["prefix"]["source"] == "events"  # shipped on for vLLM
    # the generation engine alone (the shipped file also launches an embedding engine,
    # which publishes no KV events)
    raw["engines"] = [e for e in raw["engines"] if e["model"] == "gemma3-270m"]
    raw["engines"][0]["args"] = [*raw["engines"][0]["args"], "--enable-prompt-tokens-details"]
    # a route's own prediction expires at once: the second score must come from events
    raw["scheduler"]["prefix"]["predicted_ttl_s"] = 0.01
    raw["supervisor"] = {"startup_grace_s": 300, "probe_interval_s": 1, "probe_timeout_s": 10,
                         "metrics_interval_s": 1, "inference_probe_idle_s": 3600}
    return Config(gateway=GatewayConfig.model_validate({"port": 0, "cache": {"enabled": False}}),
                  engines=EnginesConfig.model_validate(raw),
                  tenants=TenantsConfig.model_validate({"allow_anonymous": True}))



async def test_vllm_reports_a_long_prompt_stored_and_the_index_scores_it() -> None:
    cfg = config()
    async with run_gateway(cfg, ready=0) as gw:
        await gw.wait_ready(1, timeout_s=300)
        engine = gw.pool.engines[0]
        index = gw.app[SCHEDULER].index
        await wait_for(lambda: index.synced(engine), 30)
        body = {"model": engine.model, "max_tokens": 2,
                "messages": [{"role": "user", "content": synthetic_text("e2e-kv", 1500)}]}
        cached, predicted = [], []
        for _ in range(2):
            r = await gw.post("/v1/chat/completions", body)
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            predicted.append(dict(p.split("=") for p in
                                  r.headers["x-sluice-prefix-tokens"].split(", ")))
            await wait_for(lambda: index.entries(engine.id) > 0, 10)  # BlockStored arrived
            await asyncio.sleep(0.05)
        assert cached[0] == 0 and int(predicted[0]["events"]) == 0
        assert cached[1] >= 1024  # vLLM served the repeat from its prefix cache
        assert int(predicted[1]["events"]) == cached[1]
