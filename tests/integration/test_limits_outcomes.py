"""Request outcomes of the limits pipeline through ``sluice serve`` with simulated
engines: 400 ``context_length_exceeded`` over a tenant's prompt limit, and the
degradation ladder (output cap, then fallback model) announced in
``x-sluice-degraded`` while the model is saturated."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from limits.degrade import DEGRADED_HEADER
from tests.integration.limits_support import (
    auth,
    chat,
    gateways,
    in_flight,
    queue_depth,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for

pytestmark = pytest.mark.timeout(120)

CAP = 8


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory):
    cfg = write_config(
        tmp_path_factory.mktemp("outcomes"),
        tenants=[tenant("small-prompts", max_prompt_tokens=50),
                 tenant("std", max_queue_wait_s=30),
                 tenant("vip", priority="interactive")],
        engines=[sim_engine("big", model="big", speed=20.0),
                 sim_engine("small", model="small", speed=20.0),
                 sim_engine("capped", model="capped", speed=20.0)],
        models=[{"name": "big", "degradation": {"max_tokens_cap": CAP,
                                                "fallback_model": "small"}},
                {"name": "capped", "degradation": {"max_tokens_cap": CAP}}],
        saturation={"max_in_flight": 1, "max_waiting": 1000},
    )
    with gateways(cfg, 1) as (gw,):
        yield gw.url


async def test_prompt_over_tenant_limit_is_400_context_length_exceeded(gateway_url) -> None:
    async with aiohttp.ClientSession() as s:
        body = chat("word " * 200, model="big")
        async with s.post(gateway_url + "/v1/chat/completions", json=body,
                          headers=auth("small-prompts")) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        async with s.post(gateway_url + "/v1/chat/completions", json=chat("hi", model="big"),
                          headers=auth("small-prompts")) as r:
            assert r.status == 200


async def hold(session: aiohttp.ClientSession, url: str, model: str) -> aiohttp.ClientResponse:
    """A long stream that occupies ``model``'s only slot (max_in_flight 1)."""
    r = await session.post(url + "/v1/chat/completions", headers=auth("vip"),
                           json=chat("hold", 4000, stream=True, model=model))
    assert r.status == 200 and DEGRADED_HEADER not in r.headers  # interactive: never degraded
    await r.content.readuntil(b"\n\n")
    return r


async def test_ladder_caps_output_then_falls_back(gateway_url) -> None:
    url = gateway_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async def idle() -> bool:
            """big can take a request now: no earlier test's request holds its only
            slot (released after the answer's last byte) and its engine is ready
            (not saturated, so the next request must not be degraded)."""
            async with s.get(gateway_url + "/ready") as r:
                ready = (await r.json())["engines"].get("big") == "ready"
            return ready and await in_flight(s, gateway_url, model="big") == 0

        await wait_for(idle, 30, "big's earlier requests to end", poll_s=0.05)
        async with s.post(url, json=chat("hi", 50, model="big"), headers=auth("std")) as r:
            assert r.status == 200 and DEGRADED_HEADER not in r.headers  # not saturated
        busy = await hold(s, gateway_url, "big")
        try:
            async with s.post(url, json=chat("hi", 50, model="big"), headers=auth("std")) as r:
                assert r.status == 200
                assert r.headers[DEGRADED_HEADER] == f"max_tokens={CAP}, model=small"
                body = await r.json()
            assert body["model"] == "small" and body["usage"]["completion_tokens"] <= CAP
        finally:
            busy.close()


async def test_ladder_cap_only_waits_for_the_model(gateway_url) -> None:
    url = gateway_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        busy = await hold(s, gateway_url, "capped")
        body = {**chat("hi", model="capped"), "max_completion_tokens": 500}
        body.pop("max_tokens")
        pending = asyncio.ensure_future(s.post(url, json=body, headers=auth("std")))

        async def queued() -> bool:
            return await queue_depth(s, gateway_url, model="capped") == 1

        await wait_for(queued, what="the request to queue behind the stream", poll_s=0.05)
        assert not pending.done()
        busy.close()
        async with await pending as r:
            assert r.status == 200
            assert r.headers[DEGRADED_HEADER] == f"max_completion_tokens={CAP}"
            assert (await r.json())["usage"]["completion_tokens"] == CAP
