"""``sluice serve`` in front of a mixed simulated fleet: one engine per dialect
(vLLM, SGLang, TGI, TensorRT-LLM, llama.cpp; the same model on a vLLM- and an
SGLang-dialect engine), plus an external OpenAI-compatible server with neither
``/metrics``, ``/health`` nor ``/v1/completions`` — the two failures an external engine
once met (every request queued until ``queue_timeout``; the completions probe marked it
unhealthy). Each serves; the gateway's ``sluice_engine_signals`` shows what it reads."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import httpx
import pytest
import yaml

from tests.conftest import free_port
from tests.integration.limits_support import (
    FAST_SUPERVISOR,
    auth,
    chat,
    gateways,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for, wait_for_sync

pytestmark = pytest.mark.timeout(120)

DIALECT_MODELS = {"sglang": "mixed", "tgi": "tgi-model", "trtllm": "trt-model",
                  "llamacpp": "llama-model"}


@pytest.fixture(scope="module")
def bare_engine():
    """A chat-only simulator with no metrics or health route, started by the test
    (the gateway only routes to it: ``kind: external``, dialect left at its default)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.sim_engine", "--dialect", "openai", "--port",
         str(port), "--model", "bare-model", "--speed", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    def up() -> bool:
        assert proc.poll() is None, "bare engine exited"
        try:
            return httpx.get(url + "/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for_sync(up, 30, "the bare engine to start")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, bare_engine: str):
    engines = [sim_engine("v", model="mixed")]
    for dialect, model in DIALECT_MODELS.items():
        spec = sim_engine(dialect[0] if dialect != "trtllm" else "r", model=model)
        engines.append({**spec, "dialect": dialect})
    engines.append({"name": "bare", "model": "bare-model", "kind": "external",
                    "url": bare_engine + "/v1"})
    directory = write_config(tmp_path_factory.mktemp("kinds"), tenants=[tenant("t")],
                             engines=engines, gateway={"queue": {"default_max_wait_s": 10}})
    # inference probes every 0.5 s when idle: the chat-only engine must pass them
    (directory / "engines.yaml").write_text(yaml.safe_dump({
        "engines": engines, "supervisor": {**FAST_SUPERVISOR, "inference_probe_idle_s": 0.5}}))
    with gateways(directory, 1) as (gw,):
        yield gw


def _samples(text: str, name: str) -> dict[str, float]:
    """``{label text: value}`` of one metric in a Prometheus page."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", text, re.M)}


async def _wait_signals(session: aiohttp.ClientSession, url: str) -> str:
    """The gateway's /metrics once every scraped engine has reported its running count."""
    text = ""

    async def reported() -> bool:
        nonlocal text
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        sig = _samples(text, "sluice_engine_signals")
        return all(sig.get(f'engine="{e}",signal="running"') == 1.0 for e in "vstrl")

    await wait_for(reported, 20, "every engine's running count", poll_s=0.2)
    return text


@pytest.mark.load
async def test_every_dialect_serves_and_reports_its_signals(gateway) -> None:
    async with aiohttp.ClientSession() as session:
        text = await _wait_signals(session, gateway.url)
        sig = _samples(text, "sluice_engine_signals")
        want = {  # engine -> signals it must show 1 (all others 0)
            "v": {"kv_usage", "running", "waiting", "prefix_hits", "block_size", "num_blocks"},
            "s": {"kv_usage", "running", "waiting", "prefix_hits", "block_size", "num_blocks"},
            "r": {"kv_usage", "running", "waiting", "prefix_hits", "block_size", "num_blocks"},
            "t": {"running", "waiting"},
            "l": {"running", "waiting", "prefix_hits"},
            "bare": set(),
        }
        for engine, signals in want.items():
            shown = {k.split('signal="')[1].rstrip('"') for k, v in sig.items()
                     if k.startswith(f'engine="{engine}",') and v == 1.0}
            assert shown == signals, (engine, shown)
        for model in ("mixed", "tgi-model", "trt-model", "llama-model", "bare-model"):
            started = time.monotonic()
            async with session.post(gateway.url + "/v1/chat/completions", headers=auth("t"),
                                    json=chat("hello", 4, stream=True, model=model)) as r:
                assert r.status == 200, (model, await r.text())
                body = await r.text()
            assert '"usage"' in body and body.rstrip().endswith("data: [DONE]"), model
            assert time.monotonic() - started < 5, model  # admitted, not queued to timeout


async def test_unmetered_chat_only_engine_takes_load_and_stays_ready(gateway,
                                                                     bare_engine) -> None:
    """Eight concurrent requests to the engine without /metrics: all served (admitted
    by the learned limit, the rest wait their turn), and after three idle inference
    probes (chat, since it has no /v1/completions; seen arriving at the engine) it is
    still ready."""
    async with aiohttp.ClientSession() as session:
        async def one() -> int:
            async with session.post(gateway.url + "/v1/chat/completions", headers=auth("t"),
                                    json=chat("hi", 8, model="bare-model")) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(one() for _ in range(8))) == [200] * 8

        async def generated() -> int:
            async with session.get(bare_engine + "/sim/stats") as r:
                return (await r.json())["generation_tokens"]

        after_load = await generated()

        async def probed() -> bool:  # each idle inference probe generates one token
            return await generated() >= after_load + 3

        await wait_for(probed, 20, "three idle inference probes of the bare engine",
                       poll_s=0.1)
        async with session.get(gateway.url + "/metrics") as r:
            up = _samples(await r.text(), "sluice_engine_up")
        assert up['engine="bare",model="bare-model",state="ready"'] == 1.0


async def test_same_model_on_two_dialects_shares_load(gateway) -> None:
    """``mixed`` runs on a vLLM- and an SGLang-dialect engine: under concurrent load the
    scheduler, reading both dialects onto one scale, uses both."""
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            async with session.post(gateway.url + "/v1/chat/completions", headers=auth("t"),
                                    json=chat(f"request {i} " * 20, 16, model="mixed")) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(one(i) for i in range(12))) == [200] * 12
        async with session.get(gateway.url + "/metrics") as r:
            counts = _samples(await r.text(), "sluice_request_duration_seconds_count")
        served = {e: counts.get(f'engine="{e}",model="mixed"', 0.0) for e in ("v", "s")}
        assert served["v"] >= 2 and served["s"] >= 2, served
