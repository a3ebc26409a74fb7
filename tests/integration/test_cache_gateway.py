"""The response cache in the gateway's pipeline: headers, replay as stream and JSON,
what is never stored, tenant isolation, and two gateway processes sharing Redis."""

from __future__ import annotations

import asyncio
import json

import httpx
import yaml

from gateway.auth import hash_key
from loadtest.launch import gateway
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT, sse_events
from tests.support import wait_for_sync

DET = {**CHAT, "temperature": 0}
TENANTS = {"allow_anonymous": False, "tenants": [
    {"name": "a", "api_key_hashes": [hash_key("ka")]},
    {"name": "b", "api_key_hashes": [hash_key("kb")]}]}
A = {"Authorization": "Bearer ka"}
B = {"Authorization": "Bearer kb"}


def stream_text(raw: bytes) -> tuple[str, dict | None]:
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                   for c in chunks if c["choices"])
    usage = next((c["usage"] for c in chunks if not c["choices"] and c.get("usage")), None)
    return text, usage


async def test_hit_replays_as_json_and_as_stream_whichever_way_it_was_made(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake], tenants=TENANTS)) as gw:
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True}, headers=A)
        text, _ = stream_text(await r.read())
        assert r.headers["x-sluice-cache"] == "miss" and text == fake.reply
        await gw.idle()
        r = await gw.post("/v1/chat/completions", DET, headers=A)  # JSON from a stream
        body = await r.json()
        assert r.headers["x-sluice-cache"] == "hit-exact"
        assert body["choices"][0]["message"]["content"] == fake.reply
        assert body["model"] == "fake-model"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True,
                                                   "stream_options": {"include_usage": True}},
                          headers=A)
        text, usage = stream_text(await r.read())
        assert r.headers["x-sluice-cache"] == "hit-exact" and text == fake.reply
        assert usage["completion_tokens"] == len(fake.reply.split(" "))
        assert len(fake.received) == 1  # both hits were answered without the engine


async def test_sampled_and_no_cache_requests_bypass(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        for _ in range(2):  # no temperature: OpenAI's default is 1, so not cached
            r = await gw.post("/v1/chat/completions", CHAT)
            assert r.headers["x-sluice-cache"] == "bypass"
        await gw.post("/v1/chat/completions", DET)
        await gw.idle()
        r = await gw.post("/v1/chat/completions", DET, headers={"Cache-Control": "no-cache"})
        assert r.headers["x-sluice-cache"] == "bypass"
        assert len(fake.received) == 4


async def test_errors_and_aborted_streams_are_not_stored(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        fake.mode = "die_mid_stream"
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True})
        assert b"[DONE]" not in await r.read()
        fake.mode = "error500"
        assert (await gw.post("/v1/chat/completions", DET)).status == 502
        await gw.idle()
        fake.mode = "ok"
        r = await gw.post("/v1/chat/completions", DET)
        assert r.status == 200 and r.headers["x-sluice-cache"] == "miss"


async def test_tenants_never_share_entries(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake], tenants=TENANTS)) as gw:
        await gw.post("/v1/chat/completions", DET, headers=A)
        await gw.idle()
        r = await gw.post("/v1/chat/completions", DET, headers=B)
        assert r.headers["x-sluice-cache"] == "miss"
        r = await gw.post("/v1/chat/completions", DET, headers=A)
        assert r.headers["x-sluice-cache"] == "hit-exact"


async def test_two_gateway_processes_share_entries_through_redis(engines, redis_url, tmp_path):
    (fake,) = await engines(1)
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(
        {"cache": {"store_url": redis_url, "semantic": {"enabled": False}}}))
    (tmp_path / "engines.yaml").write_text(yaml.safe_dump({"engines": [
        {"name": "e0", "model": "fake-model", "kind": "external", "url": fake.url}],
        "supervisor": {"probe_interval_s": 0.2}}))
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"allow_anonymous": True}))

    def run_both() -> list[str]:
        with gateway(tmp_path, ready_timeout_s=60) as one, gateway(tmp_path, ready_timeout_s=60) as two:
            first = httpx.post(one.url + "/v1/chat/completions", json=DET, timeout=30)
            assert first.status_code == 200
            answers = []

            def hit() -> bool:  # the first gateway stores in the background
                answers.append(httpx.post(two.url + "/v1/chat/completions", json=DET, timeout=30))
                return answers[-1].headers["x-sluice-cache"] != "miss"

            wait_for_sync(hit, 5, "the second gateway to see the stored answer")
            second = answers[-1]
            return [first.headers["x-sluice-cache"], second.headers["x-sluice-cache"],
                    second.json()["choices"][0]["message"]["content"]]

    first, second, content = await asyncio.to_thread(run_both)
    assert (first, second, content) == ("miss", "hit-exact", fake.reply)


async def test_streamed_answers_with_logprobs_or_tools_are_not_stored(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        body = {**DET, "logprobs": True}
        await (await gw.post("/v1/chat/completions", {**body, "stream": True})).read()
        await gw.idle()
        r = await gw.post("/v1/chat/completions", body)  # would lack the logprobs
        assert r.headers["x-sluice-cache"] == "miss"
        await gw.idle()
        r = await gw.post("/v1/chat/completions", {**body, "stream": True})
        assert r.headers["x-sluice-cache"] == "hit-exact"  # the JSON answer was complete
