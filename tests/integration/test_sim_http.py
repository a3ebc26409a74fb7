"""The simulated engine over real loopback HTTP: SSE shape, usage, errors,
disconnect → abort, /metrics names, cache_salt isolation."""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.blocks import fallback_tokenize
from loadtest.sim_engine import SimEngine, get_profile, serve
from loadtest.sim_engine.protocol import render_chat
from tests.support import wait_for

MODEL = "sim-test"
LONG = " ".join(f"word{i % 50} of the shared context" for i in range(120))


@pytest.fixture
async def sim():
    engine = SimEngine(get_profile("cpu-gemma3-270m-quiet"), MODEL, speed=20.0)
    runner = await serve(engine, "127.0.0.1", 0)
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        yield session
    await runner.cleanup()


async def scrape(session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get("/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, s.value)
    return out


def parse_sse(raw: bytes) -> list:
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out = []
    for ev in events[:-1]:
        assert ev.startswith(b"data: ")
        payload = ev[len(b"data: "):]
        out.append(payload if payload == b"[DONE]" else json.loads(payload))
    return out


async def test_chat_stream_shape_and_usage(sim):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with sim.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 5
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
               for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    n_prompt = len(fallback_tokenize(render_chat(messages)))
    assert usage["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5,
                              "total_tokens": n_prompt + 5, "prompt_tokens_details": None}


async def test_completion_stream_without_usage_and_non_stream(sim):
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 3, "stream": True}
    async with sim.post("/v1/completions", json=body) as r:
        events = parse_sse(await r.read())
    assert events[-1] == b"[DONE]" and len(events) == 4
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])
    # completions read max_tokens only, as vLLM's do
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2, "max_completion_tokens": 4}
    async with sim.post("/v1/completions", json=body) as r:
        data = await r.json()
    assert data["usage"]["prompt_tokens"] == 4 and data["usage"]["completion_tokens"] == 2
    assert data["choices"][0]["finish_reason"] == "length"
    # chat: max_completion_tokens when not null, else max_tokens
    for caps, expected in (({"max_completion_tokens": None, "max_tokens": 3}, 3),
                           ({"max_completion_tokens": 2, "max_tokens": 5}, 2)):
        body = {"messages": [{"role": "user", "content": "x"}], **caps}
        async with sim.post("/v1/chat/completions", json=body) as r:
            assert (await r.json())["usage"]["completion_tokens"] == expected
    body = {"messages": [{"role": "user", "content": "x"}]}  # model optional, 16 tokens
    async with sim.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
    assert data["object"] == "chat.completion" and data["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": "nope"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x " * 3000}, "input_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 0}]}]}, "messages"),
])
async def test_bad_requests_are_400(sim, path, body, param):
    async with sim.post(path, json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    async with sim.post(path, data=b"{not json") as r:
        assert r.status == 400


async def test_n_choices_stream_and_not(sim):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "n": 3}
    async with sim.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 12
    body.update(stream=True, stream_options={"include_usage": True})
    async with sim.post("/v1/chat/completions", json=body) as r:
        events = parse_sse(await r.read())
    assert events[-1] == b"[DONE]"
    tokens = [c["index"] for e in events[:-2] for c in e["choices"] if c["delta"].get("content")]
    assert sorted(tokens) == [0] * 4 + [1] * 4 + [2] * 4
    assert events[-2]["usage"]["completion_tokens"] == 12


async def test_unknown_model_404(sim):
    async with sim.post("/v1/completions", json={"model": "other", "prompt": "x"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["type"] == "NotFoundError"


async def test_health_and_models(sim):
    async with sim.get("/health") as r:
        assert r.status == 200
    async with sim.get("/v1/models") as r:
        data = await r.json()
    assert data["data"][0]["id"] == MODEL and data["data"][0]["max_model_len"] == 2048


async def test_disconnect_aborts_within_2s(sim):
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1000, "stream": True}
    resp = await sim.post("/v1/completions", json=body)
    await resp.content.readuntil(b"\n\n")  # first token arrived
    m = await scrape(sim)
    assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
    resp.close()  # drop the connection

    async def aborted() -> bool:
        return (await scrape(sim))["vllm:num_requests_running"] == 0

    await wait_for(aborted, timeout_s=2.0, what="the engine to abort the request")
    assert (await scrape(sim))["vllm:kv_cache_usage_perc"] == 0.0


async def test_metrics_names_and_prefix_counters(sim):
    for _ in range(2):
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 2}
        async with sim.post("/v1/completions", json=body) as r:
            usage = (await r.json())["usage"]
    n = usage["prompt_tokens"]
    async with sim.get("/metrics") as r:
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:cache_config_info",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in fams, name
    sample = fams["vllm:num_requests_running"].samples[0]
    assert sample.labels == {"engine": "0", "model_name": MODEL}
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "433"
    m = await scrape(sim)
    assert m["vllm:prefix_cache_queries_total"] == 2 * n
    assert m["vllm:prefix_cache_hits_total"] == (n - 1) // 128 * 128  # whole blocks
    assert m["vllm:generation_tokens_total"] == 4
    assert m["vllm:time_to_first_token_seconds_count"] == 2


async def test_cache_salt_isolates_prefix_cache(sim):
    async def hits_after(salt: str | None) -> float:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 1}
        if salt:
            body["cache_salt"] = salt
        async with sim.post("/v1/completions", json=body) as r:
            assert r.status == 200
        return (await scrape(sim))["vllm:prefix_cache_hits_total"]

    assert await hits_after("tenant-a") == 0
    assert await hits_after("tenant-b") == 0
    assert await hits_after(None) == 0
    assert await hits_after("tenant-a") > 0
