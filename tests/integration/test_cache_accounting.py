"""The exact cache and the gateway's own edits of a request (issue 39, items 4-5):
one key at lookup and at store although the gateway writes the tokens/min output
cap after the lookup, and a streamed answer replayed with every delta field."""

from __future__ import annotations

import json
from typing import Any

from gateway.auth import hash_key
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT, sse_events

DET = {**CHAT, "temperature": 0}
A = {"Authorization": "Bearer ka"}


def tenants(**quota: Any) -> dict[str, Any]:
    return {"tenants": [{"name": "a", "api_key_hashes": [hash_key("ka")], **quota}]}


def reassembled(raw: bytes) -> dict[str, str]:
    """Every string field of a chat stream's deltas, concatenated per field."""
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    out: dict[str, str] = {}
    for e in events[:-1]:
        for choice in json.loads(e[6:])["choices"]:
            for key, value in (choice.get("delta") or {}).items():
                if isinstance(value, str) and key != "role":
                    out[key] = out.get(key, "") + value
    return out


async def test_a_tenant_with_tokens_per_minute_hits_the_exact_cache(engines) -> None:
    """No ``max_tokens``: the gateway writes the cap the tokens/min budget holds into
    the body after the lookup; the answer is stored under the key looked up."""
    (fake,) = await engines(1)
    cfg = make_config([fake], tenants=tenants(tokens_per_min=10_000))
    async with run_gateway(cfg) as gw:
        seen = []
        for _ in range(3):
            r = await gw.post("/v1/chat/completions", DET, headers=A)
            assert r.status == 200
            seen.append(r.headers["x-sluice-cache"])
            await gw.idle()
    assert seen == ["miss", "hit-exact", "hit-exact"]
    assert len(fake.received) == 1 and fake.received[0]["max_tokens"] == 256  # the cap sent


async def test_an_answer_cut_at_the_gateways_cap_is_not_stored(engines) -> None:
    """An answer that stopped at the cap the gateway wrote (``length``) is not what
    the request as looked up asked for: not stored. Without a quota (no cap
    written) the same answer is."""
    (fake,) = await engines(1, finish_reason="length")
    for quota, expected in (({"tokens_per_min": 10_000}, ["miss", "miss"]),
                            ({}, ["miss", "hit-exact"])):
        async with run_gateway(make_config([fake], tenants=tenants(**quota))) as gw:
            seen = []
            for _ in range(2):
                r = await gw.post("/v1/chat/completions", DET, headers=A)
                seen.append(r.headers["x-sluice-cache"])
                await gw.idle()
        assert seen == expected, quota


async def test_a_cached_stream_replays_reasoning_as_stream_and_as_json(engines) -> None:
    (fake,) = await engines(1, reasoning="first I think, then I answer")
    async with run_gateway(make_config([fake], tenants=tenants())) as gw:
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True}, headers=A)
        original = reassembled(await r.read())
        assert r.headers["x-sluice-cache"] == "miss"
        assert original == {"reasoning_content": fake.reasoning, "content": fake.reply}
        await gw.idle()
        r = await gw.post("/v1/chat/completions", DET, headers=A)
        assert r.headers["x-sluice-cache"] == "hit-exact"
        message = (await r.json())["choices"][0]["message"]
        assert message["reasoning_content"] == fake.reasoning
        assert message["content"] == fake.reply
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True}, headers=A)
        assert r.headers["x-sluice-cache"] == "hit-exact"
        assert reassembled(await r.read()) == original
    assert len(fake.received) == 1


async def test_a_streamed_tool_call_is_rebuilt_whole(engines) -> None:
    """A streamed tool call's pieces merge into one call (id, name, the arguments
    concatenated); it finishes ``stop`` here, so it is stored and replayed."""
    (fake,) = await engines(1, stream_field="tool_calls", reply='{"q": "rivers"}')
    async with run_gateway(make_config([fake], tenants=tenants())) as gw:
        r = await gw.post("/v1/chat/completions", {**DET, "stream": True}, headers=A)
        await r.read()
        await gw.idle()
        r = await gw.post("/v1/chat/completions", DET, headers=A)
        assert r.headers["x-sluice-cache"] == "hit-exact"
        (call,) = (await r.json())["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "call-1", "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "rivers"}'}}
