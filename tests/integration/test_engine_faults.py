"""What the gateway does with a misbehaving engine: an SSE event that never ends, and
each HTTP error status an engine can answer (whose fault it is, retry, Retry-After)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT, error_of, sse_events
from tests.support import wait_for

CLIENT_WAIT_S = 10.0  # the old gateway relayed nothing and never timed out: fail, not hang


async def test_an_event_past_max_event_bytes_ends_the_stream_and_frees_the_engine(engines):
    (fake,) = await engines(1, mode="unbounded_event", delay_s=0.02)
    cfg = make_config([fake])  # the shipped default: 1 MiB
    assert cfg.gateway.max_event_bytes == 1024 * 1024
    async with run_gateway(cfg) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert r.status == 200
        body = await asyncio.wait_for(r.read(), CLIENT_WAIT_S)
        await wait_for(lambda: fake.aborted == 1)  # the engine connection was closed
        assert gw.pool.engines[0].in_flight == 0
    events = sse_events(body)
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    err = json.loads(events[-1][6:])["error"]
    assert err["code"] == "upstream_error" and "1048576 bytes" in err["message"]
    assert json.loads(events[1][6:])["choices"][0]["delta"]["content"] == fake.reply.split()[0] + " "
    assert len(events) == 3 and len(body) < 2048  # no byte of the unfinished event
    assert 1024 * 1024 <= fake.sent_bytes < 4 * 1024 * 1024


async def test_an_oversize_first_event_is_a_502_and_not_retried(engines):
    e0, e1 = await engines(2, mode="unbounded_event", delay_s=0.02)
    cfg = make_config([e0, e1], gateway={"max_event_bytes": 256 * 1024})
    async with run_gateway(cfg) as gw:
        r = await gw.post("/v1/completions", {"model": "fake-model", "prompt": "x", "stream": True})
        assert r.status == 502
        err = await error_of(r)
        assert err["code"] == "upstream_error" and "262144 bytes" in err["message"]
    assert len(e0.received) + len(e1.received) == 1


@pytest.mark.load
async def test_only_complete_events_reset_the_idle_deadline(engines):
    (fake,) = await engines(1, mode="unbounded_event", delay_s=0.02)
    cfg = make_config([fake], gateway={"max_event_bytes": 64 * 1024 * 1024,
                                       "timeouts": {"idle_s": 0.3}})
    async with run_gateway(cfg) as gw:
        loop = asyncio.get_running_loop()
        started = loop.time()
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        events = sse_events(await asyncio.wait_for(r.read(), CLIENT_WAIT_S))
        elapsed = loop.time() - started
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_timeout"
    assert 0.3 <= elapsed < 3.0
    assert fake.sent_bytes >= 65536  # bytes kept arriving: they were not progress


async def test_only_complete_events_count_for_the_first_token_deadline(engines):
    (fake,) = await engines(1, mode="unbounded_event", delay_s=0.02)
    cfg = make_config([fake], gateway={"max_event_bytes": 64 * 1024 * 1024,
                                       "timeouts": {"first_token_s": 0.3}})
    async with run_gateway(cfg) as gw:
        r = await asyncio.wait_for(gw.post(
            "/v1/completions", {"model": "fake-model", "prompt": "x", "stream": True}), CLIENT_WAIT_S)
        assert r.status == 504
        assert (await error_of(r))["code"] == "upstream_timeout"


@pytest.mark.parametrize("status", [429, 503, 401, 403, 404])
async def test_overloaded_or_refusing_engine_is_retried_on_another(engines, status):
    bad, good = await engines(2)
    bad.mode, bad.status = "status", status
    async with run_gateway(make_config([bad, good])) as gw:
        sent = 0
        while len(bad.received) < 2 and sent < 20:  # until the bad engine was picked twice
            r = await gw.post("/v1/chat/completions", CHAT)
            sent += 1
            assert r.status == 200
            assert (await r.json())["choices"][0]["message"]["content"] == good.reply
    assert len(bad.received) == 2 and len(good.received) == sent


@pytest.mark.parametrize(("status", "error_type", "code"), [
    (429, "rate_limit_error", "rate_limit_exceeded"),
    (503, "server_error", "overloaded"),
])
async def test_overloaded_engines_pass_their_retry_after(engines, status, error_type, code):
    e0, e1 = await engines(2, mode="status", status=status, error_headers={"Retry-After": "7"})
    async with run_gateway(make_config([e0, e1])) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == status and r.headers["Retry-After"] == "7"
        err = await error_of(r)
        assert (err["type"], err["code"]) == (error_type, code)
        assert len(e0.received) == len(e1.received) == 1  # both engines were tried
        e0.error_headers = e1.error_headers = {}  # no Retry-After: the gateway still sends one
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert r.status == status and int(r.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_engine_refusing_the_gateway_is_a_logged_502(engines, status, caplog):
    (fake,) = await engines(1, mode="status", status=status, error_message="Invalid API key")
    async with run_gateway(make_config([fake])) as gw:
        with caplog.at_level(logging.ERROR, logger="sluice.proxy"):
            r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 502
        err = await error_of(r)
        assert (err["type"], err["code"]) == ("server_error", "upstream_error")
        assert f"HTTP {status}" in err["message"] and "Invalid API key" not in err["message"]
    assert any(f"answered HTTP {status}: Invalid API key" in m for m in caplog.messages)


async def test_engine_400_for_a_bad_request_stays_a_400_and_is_not_retried(engines):
    msg = ("This model's maximum context length is 2048 tokens. However, you requested "
           "4000 tokens.")
    e0, e1 = await engines(2, mode="status", status=400, error_message=msg)
    async with run_gateway(make_config([e0, e1])) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 400
        err = await error_of(r)
        assert (err["type"], err["code"], err["message"]) == (
            "invalid_request_error", "context_length_exceeded", msg)
        e0.error_message = e1.error_message = "temperature must be non-negative"
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 400
        assert (await error_of(r))["code"] == "invalid_request"
    assert len(e0.received) + len(e1.received) == 2


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"text"', b"{", b"\xff"])
async def test_an_answer_that_is_not_a_json_object_is_retried_then_a_502(engines, raw):
    bad, good = await engines(2)
    bad.mode, bad.raw_body = "raw", raw
    async with run_gateway(make_config([bad, good])) as gw:
        while not bad.received:  # until the bad engine was picked: the good one answers
            r = await gw.post("/v1/chat/completions", CHAT)
            assert r.status == 200
            assert (await r.json())["choices"][0]["message"]["content"] == good.reply
        good.mode, good.raw_body = "raw", raw
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 502
        assert (await error_of(r))["code"] == "upstream_error"


async def test_an_answer_with_nan_is_relayed_byte_for_byte(engines):
    """Python's JSON (which vLLM's server writes) allows NaN; the fast decoder does not,
    so the answer is decoded the slow way, and still relayed as the engine sent it."""
    (fake,) = await engines(1)
    fake.mode = "raw"
    fake.raw_body = (b'{"id":"x","object":"chat.completion","model":"fake-model","choices":'
                     b'[{"index":0,"message":{"role":"assistant","content":"hi"},'
                     b'"logprobs":{"content":[{"token":"hi","logprob":NaN}]},'
                     b'"finish_reason":"stop"}],"usage":{"prompt_tokens":3,'
                     b'"completion_tokens":1,"total_tokens":4}}')
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 200
        assert await r.read() == fake.raw_body
