"""The simulator's KV connector over real loopback HTTP: the two legs of a
disaggregated request field by field as vLLM's proxy sends them
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``), partial reads
over a local prefix, blocks gone (lease expired) → local prefill or failure,
disconnect during the prefill leg, and roles."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.blocks import fallback_tokenize
from loadtest.sim_engine import SimEngine, get_profile, serve
from loadtest.sim_engine.__main__ import parse_args
from loadtest.sim_engine.disagg import SimConnector
from loadtest.sim_engine.protocol import render_chat
from tests.conftest import free_port
from tests.support import wait_for

MODEL = "sim-pd"
PROFILE = get_profile("cpu-gemma3-270m-quiet")  # 128-token blocks, 18 KiB per token
MESSAGES = [{"role": "user", "content": " ".join(f"token{i}" for i in range(700))}]
N_PROMPT = len(fallback_tokenize(render_chat(MESSAGES)))
N_BLOCKS = -(-N_PROMPT // PROFILE.block_size)


class Sim:
    def __init__(self, engine: SimEngine, connector: SimConnector, url: str,
                 session: aiohttp.ClientSession) -> None:
        self.engine, self.connector, self.url, self.session = engine, connector, url, session

    def post(self, body: dict, **kw) -> aiohttp.client._RequestContextManager:
        return self.session.post(self.url + "/v1/chat/completions", json=body, **kw)

    async def metrics(self) -> dict[str, float]:
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples}


@asynccontextmanager
async def sim(role: str, **kw) -> AsyncIterator[Sim]:
    engine = SimEngine(PROFILE, MODEL, speed=50.0)
    connector = SimConnector(engine, role, **kw)
    port = free_port()
    runner = await serve(engine, "127.0.0.1", port, connector)
    async with aiohttp.ClientSession() as session:
        try:
            yield Sim(engine, connector, f"http://127.0.0.1:{port}", session)
        finally:
            await runner.cleanup()



def prefill_body(max_tokens: int = 6) -> dict:
    """What vLLM's toy proxy sends to the prefill engine."""
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}


def decode_body(params: dict, max_tokens: int = 6) -> dict:
    """The original request plus the prefill engine's ``kv_transfer_params``."""
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params}


async def prefill(p: Sim, request_id: str = "req-1") -> dict:
    async with p.post(prefill_body(), headers={"X-Request-Id": request_id}) as r:
        assert r.status == 200
        return await r.json()


async def test_prefill_leg_returns_vllm_kv_transfer_params_and_holds_blocks():
    async with sim("prefill") as p:
        answer = await prefill(p, "req-1")
        params = answer["kv_transfer_params"]
        assert answer["id"] == "chatcmpl-req-1"
        assert answer["usage"]["completion_tokens"] == 1
        assert params["remote_request_id"].startswith("chatcmpl-req-1-")
        assert len(params["remote_block_ids"]) == 1  # one KV-cache group
        assert len(params["remote_block_ids"][0]) == N_BLOCKS
        assert {k: v for k, v in params.items()
                if k not in ("remote_request_id", "remote_block_ids")} == {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": p.connector.engine_id,
            "remote_host": "127.0.0.1", "remote_port": int(p.url.rsplit(":", 1)[1]),
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": N_PROMPT,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0}
        # the finished request's blocks stay allocated for the read
        assert p.connector.held_requests == 1
        assert p.engine.kv.num_free_blocks == PROFILE.num_blocks - 1 - N_BLOCKS


async def test_decode_leg_reads_the_blocks_and_streams_the_answer():
    async with sim("prefill") as p, sim("decode", transfer_gbps=10.0) as d:
        params = (await prefill(p))["kv_transfer_params"]
        async with d.post(decode_body(params), headers={"X-Request-Id": "req-1"}) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b'"content":" ') == 6 and b"chatcmpl-req-1" in raw
        # the read freed the prefill engine's blocks
        assert p.connector.held_requests == 0
        assert p.engine.kv.num_free_blocks == PROFILE.num_blocks - 1
        # the decode engine loaded every prompt token but the last, which it recomputes
        assert d.engine.scheduler.counters.external_prefix_cache_hits == N_PROMPT - 1
        m = await d.metrics()
        block_bytes = PROFILE.kv_bytes_per_block
        assert m["vllm:nixl_xfer_time_seconds_count"] == 1
        assert m["vllm:nixl_bytes_transferred_sum"] == N_BLOCKS * block_bytes
        assert m["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(
            N_BLOCKS * block_bytes * 8 / 10e9)
        assert m["vllm:nixl_num_failed_transfers_total"] == 0


async def test_decode_leg_reads_only_blocks_missing_from_its_prefix_cache():
    async with sim("prefill") as p, sim("decode") as d:
        async with d.post({"model": MODEL, "messages": MESSAGES, "max_tokens": 1}) as r:
            assert r.status == 200  # warms d's prefix cache with the same prompt
        local = (N_PROMPT - 1) // PROFILE.block_size  # vLLM's cap: last token recomputed
        params = (await prefill(p))["kv_transfer_params"]
        async with d.post(decode_body(params)) as r:
            assert r.status == 200
            await r.read()
        m = await d.metrics()
        assert m["vllm:nixl_bytes_transferred_sum"] == (N_BLOCKS - local) * PROFILE.kv_bytes_per_block
        assert p.connector.held_requests == 0


async def test_expired_blocks_are_prefilled_locally_by_default():
    async with sim("prefill", lease_s=0.5) as p, sim("decode") as d:
        params = (await prefill(p))["kv_transfer_params"]
        await wait_for(lambda: p.connector.held_requests == 0)  # 0.5 s / speed 50
        assert p.engine.kv.num_free_blocks == PROFILE.num_blocks - 1
        async with d.post(decode_body(params)) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        assert d.engine.scheduler.counters.external_prefix_cache_hits == 0
        assert (await p.metrics())["vllm:nixl_num_kv_expired_reqs_total"] == 1
        m = await d.metrics()
        assert m["vllm:nixl_num_failed_transfers_total"] == 1
        assert m["vllm:nixl_xfer_time_seconds_count"] == 0


async def test_blocks_gone_with_fail_policy_is_a_500():
    async with sim("prefill") as p, sim("decode", failure_policy="fail") as d:
        params = (await prefill(p))["kv_transfer_params"]
        params = {**params, "remote_engine_id": "a-previous-life"}  # restarted prefill engine
        async with d.post(decode_body(params)) as r:
            assert r.status == 500
            assert (await r.json())["error"]["message"].startswith("KV transfer")
        assert p.connector.held_requests == 1  # still waiting for the right reader


async def test_disconnect_during_prefill_leg_frees_the_blocks():
    async with sim("prefill") as p:
        body = {**prefill_body(), "max_tokens": 400}  # long enough to cut
        task = asyncio.create_task(p.session.post(p.url + "/v1/chat/completions", json=body))
        await wait_for(lambda: p.engine.scheduler.counters.generation_tokens >= 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: not p.engine.scheduler.has_work)
        assert p.connector.held_requests == 0
        assert p.engine.kv.num_free_blocks == PROFILE.num_blocks - 1


async def test_decode_role_ignores_a_prefill_leg():
    async with sim("decode") as d:
        async with d.post(prefill_body()) as r:
            answer = await r.json()
        assert answer["kv_transfer_params"] is None
        assert d.connector.held_requests == 0
        assert d.engine.kv.num_free_blocks == PROFILE.num_blocks - 1


def test_role_needs_a_connector():
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--role", "prefill"])
    args = parse_args(["--port", "1", "--role", "decode", "--kv-connector", "NixlConnector",
                       "--kv-transfer-gbps", "25"])
    assert (args.role, args.kv_transfer_gbps) == ("decode", 25.0)
