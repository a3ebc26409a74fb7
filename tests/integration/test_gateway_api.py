"""The OpenAI surface of the gateway over loopback HTTP, in front of fake engines."""

from __future__ import annotations

import asyncio
import json

from gateway.auth import hash_key
from tests.integration.conftest import make_config, run_gateway
from tests.support import wait_for

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]}


async def error_of(resp) -> dict:
    assert resp.headers["Content-Type"].startswith("application/json")
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_chat_and_completions_non_streaming(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 200
        body = await r.json()
        assert body["choices"][0]["message"]["content"] == fake.reply
        assert body["usage"]["completion_tokens"] == len(fake.reply.split(" "))
        assert r.headers["x-sluice-engine"] == "e0"
        first_id = r.headers["x-request-id"]
        assert len(first_id) == 32 and int(first_id, 16) >= 0
        r = await gw.post("/v1/completions", {"model": "fake-model", "prompt": "Once"})
        assert (await r.json())["choices"][0]["text"] == fake.reply
        assert r.headers["x-request-id"] != first_id and len(r.headers["x-request-id"]) == 32
        assert fake.headers[-1]["x-request-id"] == r.headers["x-request-id"]


async def test_validation_errors_name_the_param(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", data=b"{not json",
                          headers={"Content-Type": "application/json"})
        assert r.status == 400
        assert (await error_of(r))["code"] == "invalid_request"
        r = await gw.post("/v1/chat/completions", {"model": "fake-model"})
        assert r.status == 400 and (await error_of(r))["param"] == "messages"
        r = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": "ten"})
        assert r.status == 400 and (await error_of(r))["param"] == "max_tokens"
        r = await gw.post("/v1/chat/completions",
                          {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]})
        assert r.status == 400 and (await error_of(r))["param"] == "messages[0].role"
        r = await gw.post("/v1/completions", {"model": "fake-model", "prompt": 5})
        assert r.status == 400 and (await error_of(r))["param"] == "prompt"
        r = await gw.post("/v1/chat/completions", [1, 2])
        assert r.status == 400
        assert fake.received == []  # nothing invalid reached the engine


async def test_unknown_model_is_404(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "model": "gpt-17"})
        assert r.status == 404
        err = await error_of(r)
        assert err["code"] == "model_not_found" and err["param"] == "model"


async def test_body_limit_is_8_mib_by_default_and_413_above(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        big = {**CHAT, "metadata": {"blob": "a" * (2 * 1024 * 1024)}}  # bytes, not tokens
        r = await gw.post("/v1/chat/completions", big)
        assert r.status == 200  # above aiohttp's own 1 MiB default
        huge = {**CHAT, "metadata": {"blob": "a" * (9 * 1024 * 1024)}}
        r = await gw.post("/v1/chat/completions", huge)
        assert r.status == 413
        assert (await error_of(r))["code"] == "request_too_large"


async def test_no_ready_engine_is_503_with_integer_retry_after(engines):
    (fake,) = await engines(1)
    cfg = make_config([fake], models=["other-model"])
    async with run_gateway(cfg, ready=1) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "model": "other-model"})
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert (await error_of(r))["code"] == "engine_unavailable"


async def test_engine_timeout_is_504(engines):
    (fake,) = await engines(1, mode="slow_first", delay_s=2.0)
    cfg = make_config([fake], gateway={"timeouts": {"non_stream_s": 0.3, "first_token_s": 0.3}})
    async with run_gateway(cfg) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 504
        assert (await error_of(r))["code"] == "upstream_timeout"
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert r.status == 504  # first-token timeout before any byte: a clean error


async def test_unknown_route_and_method_are_openai_errors(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.session.get(gw.url + "/v1/nope")
        assert r.status == 404 and (await error_of(r))["code"] == "not_found"
        r = await gw.session.get(gw.url + "/v1/chat/completions")
        assert r.status == 405


async def test_unparseable_http_is_an_openai_error(engines):
    """A header longer than aiohttp's 8190-byte field limit never reaches the
    middlewares; the connection handler still answers in the OpenAI shape."""
    (eng,) = await engines()
    async with run_gateway(make_config([eng])) as gw:
        r = await gw.session.post(f"{gw.url}/v1/chat/completions", json=[],
                                  headers={"Authorization": "Bearer " + "k" * 10_000})
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_request"
    assert "8190" in body["error"]["message"]


async def test_auth_keys_and_anonymous(engines):
    (fake,) = await engines(1)
    tenants = {"allow_anonymous": False,
               "tenants": [{"name": "acme", "api_key_hashes": [hash_key("sk-acme")]}]}
    async with run_gateway(make_config([fake], tenants=tenants)) as gw:
        r = await gw.post("/v1/chat/completions", CHAT)
        assert r.status == 401 and (await error_of(r))["type"] == "authentication_error"
        r = await gw.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sk-bad"})
        assert r.status == 401
        r = await gw.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sk-acme"})
        assert r.status == 200
        r = await gw.post("/v1/chat/completions", CHAT, headers={"x-api-key": "sk-acme"})
        assert r.status == 200
    # anonymous allowed (loopback) — but a wrong key is still refused
    tenants["allow_anonymous"] = True
    async with run_gateway(make_config([fake], tenants=tenants)) as gw:
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200
        r = await gw.post("/v1/chat/completions", CHAT, headers={"x-api-key": "sk-bad"})
        assert r.status == 401


async def test_client_credentials_and_hop_by_hop_headers_never_reach_engine(engines):
    (fake,) = await engines(1)
    tenants = {"tenants": [{"name": "acme", "api_key_hashes": [hash_key("sk-acme")]}]}
    async with run_gateway(make_config([fake], tenants=tenants)) as gw:
        r = await gw.post("/v1/chat/completions", CHAT, headers={
            "Authorization": "Bearer sk-acme", "Cookie": "session=secret",
            "Proxy-Authorization": "Basic eA==", "Keep-Alive": "timeout=5", "TE": "trailers",
            "x-api-key": "sk-acme", "Upgrade": "h2c", "x-request-id": "req-123"})
        assert r.status == 200
    sent = {k.lower() for k in fake.headers[-1]}
    for h in ("authorization", "x-api-key", "cookie", "proxy-authorization", "keep-alive",
              "te", "upgrade"):
        assert h not in sent
    # the engine gets the gateway's own id, not the client's (issue 39 item 14)
    assert fake.headers[-1]["x-request-id"] == r.headers["x-request-id"] != "req-123"


async def test_unknown_fields_pass_through_untouched(engines):
    (fake,) = await engines(1)
    extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
             "tool_choice": "auto", "response_format": {"type": "json_object"}, "logprobs": True,
             "top_logprobs": 2, "n": 1, "seed": 7, "vendor_knob": {"a": [1, 2]},
             "max_completion_tokens": 3}
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, **extra})
        assert r.status == 200
        body = await r.json()
    assert fake.received[-1] == {**CHAT, **extra}
    assert body["choices"][0]["message"]["content"] == " ".join(fake.reply.split(" ")[:3])


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def test_stream_split_inside_utf8_is_passed_through_intact(engines):
    (fake,) = await engines(1, mode="split_utf8")
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Accel-Buffering"] == "no"
        assert "Content-Length" not in r.headers
        raw = await r.read()
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1])
    assert text == fake.reply
    # the engine was asked for usage, but the client did not ask: no usage-only chunk
    assert fake.received[-1]["stream_options"] == {"include_usage": True}
    assert all(json.loads(e[6:]).get("choices") for e in events[:-1])


async def test_stream_usage_when_client_asks(engines):
    (fake,) = await engines(1)
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/completions", {"model": "fake-model", "prompt": "x", "stream": True,
                                              "stream_options": {"include_usage": True}})
        events = sse_events(await r.read())
    usage = json.loads(events[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(fake.reply.split())


async def test_engine_failure_mid_stream_sends_error_event_and_no_done(engines):
    e0, e1 = await engines(2, mode="die_mid_stream")
    async with run_gateway(make_config([e0, e1])) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert r.status == 200
        events = sse_events(await r.read())
    assert b"[DONE]" not in events[-1]
    err = json.loads(events[-1][6:])["error"]
    assert err["code"] == "upstream_error"
    # bytes had reached the client: no retry on the other engine
    assert len(e0.received) + len(e1.received) == 1


async def test_retry_on_other_engine_before_first_byte(engines):
    bad, good = await engines(2)
    bad.mode = "error500"
    async with run_gateway(make_config([bad, good])) as gw:
        for _ in range(4):
            r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
            assert r.status == 200
            assert sse_events(await r.read())[-1] == b"data: [DONE]"
    assert len(good.received) == 4


async def test_idle_timeout_mid_stream_is_an_error_event(engines):
    (fake,) = await engines(1, mode="stall", delay_s=3.0)
    cfg = make_config([fake], gateway={"timeouts": {"idle_s": 0.3}})
    async with run_gateway(cfg) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        events = sse_events(await r.read())
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_timeout"
    assert all(b"[DONE]" not in e for e in events)


async def test_client_disconnect_aborts_upstream(engines):
    (fake,) = await engines(1, delay_s=0.2)  # streams slowly
    async with run_gateway(make_config([fake])) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        await r.content.readany()
        assert fake.running == 1
        r.close()  # the client goes away mid-stream
        await wait_for(lambda: fake.running == 0, 2.0, "the engine to abort the request")
        assert fake.aborted == 1
        assert gw.pool.engines[0].in_flight == 0


async def test_models_lists_ready_engines_while_one_is_down(engines):
    a, b = await engines(2)
    b.model = "second-model"
    async with run_gateway(make_config([a, b])) as gw:
        r = await gw.session.get(gw.url + "/v1/models")
        assert sorted(m["id"] for m in (await r.json())["data"]) == ["fake-model", "second-model"]
        assert (await gw.session.get(gw.url + "/ready")).status == 200
        await b.stop()
        await wait_for(lambda: not gw.pool.engines[1].routable, 5, "the stopped engine to leave")
        r = await gw.session.get(gw.url + "/v1/models")
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["fake-model"]
        r = await gw.session.get(gw.url + "/ready")
        assert r.status == 503 and (await r.json())["missing_models"] == ["second-model"]
        assert (await gw.session.get(gw.url + "/health")).status == 200


async def test_first_token_timeouts_count_as_failed_probes(engines):
    (fake,) = await engines(1, mode="slow_first", delay_s=5.0)
    cfg = make_config([fake], gateway={"timeouts": {"first_token_s": 0.25}})
    async with run_gateway(cfg) as gw:
        engine = gw.pool.engines[0]
        for _ in range(2):  # /health answers, but no token ever comes
            r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
            assert r.status == 504
        assert engine.breaker.state.value == "open" and not engine.routable
        metrics = await (await gw.session.get(gw.url + "/metrics")).text()
        assert 'sluice_engine_breaker_open{engine="e0",model="fake-model"} 1.0' in metrics
        # the two requests, then the runner's failed inference probes
        await wait_for(lambda: engine.state.value == "unhealthy", 3, "the engine to turn unhealthy")
        assert engine.breaker.failures >= 2
        # /health answers, but two more inference probes time out: it stays unhealthy
        probes = fake.aborted
        await wait_for(lambda: fake.aborted >= probes + 2, 5, "two more timed-out probes")
        assert engine.state.value == "unhealthy"
        fake.mode = "ok"  # a 1-token completion answers again: back in service
        await wait_for(lambda: engine.routable, 3, "the engine to be routable again")


async def test_a_stalled_request_body_times_out_with_408(engines):
    (fake,) = await engines(1)
    cfg = make_config([fake], gateway={"timeouts": {"request_body_s": 0.3}})
    async with run_gateway(cfg) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 408")
        writer.close()
        # the error body is OpenAI-shaped
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length")))
        body = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
        assert body["error"]["code"] == "request_timeout"
