"""What the gateway buffers of an engine's answer is bounded by config: a
non-streamed answer by ``gateway.max_response_bytes`` (a clean 502 past it); streamed
events by ``max_event_bytes`` (``test_engine_faults``)."""

from __future__ import annotations

import json

from tests.integration.conftest import make_config, run_gateway

CHAT = {"model": "fake-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}]}


async def test_non_streamed_answer_longer_than_the_bound_is_a_clean_502(engines) -> None:
    """``gateway.max_response_bytes`` bounds what the gateway buffers of an engine's
    non-streamed answer (the engine controls its size)."""
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 4096},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    (engine,) = await engines(1, mode="raw", raw_body=json.dumps(answer).encode())
    async with run_gateway(make_config([engine], gateway={"max_response_bytes": 2048})) as gw:
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            body = await r.json()
            assert r.status == 502, body
            assert "2048 bytes" in body["error"]["message"]
        engine.raw_body = json.dumps({**answer, "choices": [
            {**answer["choices"][0], "message": {"role": "assistant", "content": "short"}}]}).encode()
        async with await gw.post("/v1/chat/completions", CHAT) as r:
            assert r.status == 200, await r.text()
        await gw.idle()
