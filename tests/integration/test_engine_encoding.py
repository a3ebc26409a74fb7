"""An engine (or a proxy in front of it) that compresses when asked must not break
requests: the gateway asks for ``identity`` on every upstream request (answers,
probes, scrapes), and a compressed answer it did not ask for is a clean 502
(issue 39, item 12)."""

from __future__ import annotations

import json

import pytest

from engines.health import probe_inference, probe_ready
from gateway.keys import SESSION
from tests.integration.conftest import make_config, run_gateway
from tests.support import wait_for

CHAT = {"model": "fake-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_that_compresses_when_asked(engines, stream: bool) -> None:
    (engine,) = await engines(1, compress="asked")
    async with run_gateway(make_config([engine])) as gw:
        async with await gw.post("/v1/chat/completions", {**CHAT, "stream": stream}) as r:
            raw = await r.read()
            assert r.status == 200, raw
        if stream:
            assert raw.rstrip().endswith(b"data: [DONE]")
            assert b'"content": "engine, "' in raw
        else:
            assert "fake engine" in json.loads(raw)["choices"][0]["message"]["content"]
        assert engine.headers[-1].get("Accept-Encoding") == "identity"
        await gw.idle()


async def test_probes_of_a_compressing_engine(engines) -> None:
    """The inference probe and the readiness probe read the engine's JSON."""
    (engine,) = await engines(1, compress="asked")
    async with run_gateway(make_config([engine])) as gw:
        session = gw.app[SESSION]
        assert await probe_ready(session, engine.url, "fake-model", 5)
        assert await probe_inference(session, engine.url, "fake-model", 5)


async def test_compressed_answer_not_asked_for_is_a_clean_502(engines) -> None:
    (engine,) = await engines(1, compress="always")
    async with run_gateway(make_config([engine]), ready=0) as gw:
        await wait_for(lambda: gw.pool.engines and gw.pool.engines[0].routable, 10,
                       "the engine to be routable")
        for stream in (False, True):
            async with await gw.post("/v1/chat/completions", {**CHAT, "stream": stream}) as r:
                body = await r.json()
                assert r.status == 502, body
                assert body["error"]["code"] == "upstream_error"
        await gw.idle()

