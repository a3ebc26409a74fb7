"""End to end (issue 41): ``sluice serve`` with the shipped configuration in front of
the engine it launches (the packaged CPU vLLM engine; and llama.cpp's ``llama-server``
when built): a 64-client closed-loop burst for 30 s is answered, whatever is refused
carries ``Retry-After``, and no client times out; the gateway's KV capacity is the
engine's own figure.

Run with ``flock /tmp/sluice-heavy.lock`` on a shared machine (it launches engines).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from engines.kinds.llamacpp import server_binary
from loadtest.burst import chat_body, closed_loop
from loadtest.launch import RunningGateway, gateway, llamacpp_config
from tests.support import wait_for_sync

pytestmark = [pytest.mark.slow, pytest.mark.load]
MODEL = "gemma3-270m"
PROMPTS = ["Explain in two sentences why the sky is blue.",
           "Write a short poem about a river at night.",
           "List three uses of a paperclip.",
           "What is the capital of France, and why is it famous?"]


@pytest.fixture(scope="module", params=["vllm", "llamacpp"])
def served(request, tmp_path_factory) -> Iterator[tuple[str, RunningGateway]]:
    tmp: Path = tmp_path_factory.mktemp(request.param)
    config = None
    if request.param == "llamacpp":
        if not server_binary().is_file():
            pytest.skip(f"{server_binary()} missing: run `make llama-server` first")
        config = llamacpp_config(tmp / "config")
    with gateway(config, log_path=tmp / "gateway.log") as gw:
        yield request.param, gw


def engine_stats(gw: RunningGateway) -> dict:
    """The generation engine's entry in ``/admin/stats`` (the shipped config also
    launches an embedding engine)."""
    (engine,) = [e for e in httpx.get(gw.url + "/admin/stats", timeout=10).json()["engines"]
                 if e["model"] == MODEL]
    return engine


def test_gateway_kv_capacity_is_the_engines(served) -> None:
    kind, gw = served
    (url,) = gw.engine_urls(MODEL)
    if kind == "vllm":
        text = httpx.get(url + "/metrics", timeout=10).text
        (info,) = [line for line in text.splitlines()
                   if line.startswith("vllm:cache_config_info{")]
        m = re.search(r'kv_cache_size_tokens="(\d+)"', info)
        assert m, "vllm:cache_config_info has no kv_cache_size_tokens"
        engine_tokens = int(m.group(1))
        blocks = re.search(r'num_gpu_blocks="(\d+)"', info)  # labels come sorted: after it
        # Gemma 3's hybrid attention: the engine's figure, not num_gpu_blocks x block_size
        assert blocks and engine_tokens < int(blocks.group(1)) * 128
    else:
        props = httpx.get(url + "/props", timeout=10).json()
        engine_tokens = props["default_generation_settings"]["n_ctx"]
    # the gateway reads it at its first scrape of the engine, which may follow readiness
    wait_for_sync(lambda: engine_stats(gw)["kv_capacity_tokens"] is not None, timeout_s=30,
                  what="the gateway's first scrape of the engine")
    assert engine_stats(gw)["kv_capacity_tokens"] == engine_tokens


def test_a_64_client_burst_is_answered_refused_with_retry_after_and_never_times_out(
        served) -> None:
    kind, gw = served
    bodies = [chat_body(MODEL, p, 32) for p in PROMPTS]

    async def burst():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await closed_loop(s, gw.url + "/v1/chat/completions", bodies, 64, 30.0,
                                     timeout_s=60.0, retry_cap_s=2.0)

    out = asyncio.run(burst()).summary()
    print(kind, out, engine_stats(gw))
    assert out["answered"] > 0 and out["errors"] == 0
    assert out["timeouts"] == 0
    assert out["refused"] == out["refused_with_retry_after"]
