"""Every endpoint a modern client calls, through the gateway, with the real ``openai``
and ``anthropic`` SDKs as clients and :class:`FakeEngine` (vLLM 0.32's shapes) behind
it: OpenAI Responses (with the gateway-owned ``previous_response_id`` chain, across two
gateway processes sharing Redis), Anthropic Messages, Embeddings (cached), tokenize;
each governed like chat (tokens counted per endpoint, 429 with Retry-After)."""

from __future__ import annotations

import secrets
from typing import Any

import anthropic
import openai
import pytest

from tests.integration.conftest import make_config, run_gateway
from tests.integration.fake_engine import FakeEngine
from tests.integration.limits_support import tenant
from tests.integration.test_observability import scrape, value

pytestmark = pytest.mark.asyncio

TENANTS = {"allow_anonymous": False, "tenants": [tenant("acme"), tenant("other")]}


def oai(gw: Any, name: str = "acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=f"key-{name}", max_retries=0)


def claude(gw: Any, name: str = "acme") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=f"key-{name}", max_retries=0)


def redis_cache() -> dict[str, Any]:
    """A cache in a Redis db of its own (db 11), keys under a fresh namespace per test
    run through the tenant's namespace being the same: ids are unique (uuid)."""
    return {"cache": {"store_url": "redis://127.0.0.1:6379/11",
                      "semantic": {"enabled": False}}}


async def test_responses_create_stream_and_tokens_counted(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        client = oai(gw)
        before = await scrape(gw)
        r = await client.responses.create(model=engine.model, input="Say hi",
                                          max_output_tokens=4)
        assert r.status == "completed" and r.output_text == "Hello from the fake"
        assert r.usage.input_tokens == 7 and r.usage.output_tokens == 4
        events = [e async for e in await client.responses.create(
            model=engine.model, input="Say hi", max_output_tokens=3, stream=True)]
        types = [e.type for e in events]
        assert types == ["response.created"] + ["response.output_text.delta"] * 3 + [
            "response.completed"]
        assert events[-1].response.usage.output_tokens == 3
        # the engine was sent the body as the client wrote it, no include_usage added
        assert "stream_options" not in engine.received[-1]
        await gw.idle()
        after = await scrape(gw)
        moved = value(after, "sluice_tokens_total", endpoint="responses", kind="completion") \
            - value(before, "sluice_tokens_total", endpoint="responses", kind="completion")
        assert moved == 7
        assert value(after, "sluice_tokens_total", endpoint="responses", kind="prompt") == 14


async def test_previous_response_id_chain_across_gateways_and_engines() -> None:
    """Turn 1 on gateway A and engine 1; turn 2 on gateway B (another process's
    view: its own app, the same Redis) and engine 2, which never saw turn 1; turn 3
    back on A after engine 1 is gone. The gateway sends each engine the whole
    conversation."""
    e1, e2 = await FakeEngine().start(), await FakeEngine().start()
    try:
        cfg_a = make_config([e1], tenants=TENANTS, gateway=redis_cache())
        cfg_b = make_config([e2], tenants=TENANTS, gateway=redis_cache())
        async with run_gateway(cfg_a) as a, run_gateway(cfg_b) as b:
            first = await oai(a).responses.create(model=e1.model, input="My name is Ada.",
                                                  instructions="Be brief.", max_output_tokens=2)
            second = await oai(b).responses.create(model=e2.model, input="What is my name?",
                                                   previous_response_id=first.id,
                                                   max_output_tokens=3)
            sent = e2.received[-1]
            assert "previous_response_id" not in sent
            assert sent["input"] == [
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Hello from"},
                {"role": "user", "content": "What is my name?"}]
            assert "instructions" not in sent  # as OpenAI: not carried to the next turn
            await e1.stop()
            e3 = await FakeEngine().start()
            try:
                cfg_c = make_config([e3], tenants=TENANTS, gateway=redis_cache())
                async with run_gateway(cfg_c) as c:
                    stream = await oai(c).responses.create(
                        model=e3.model, input="And again?", previous_response_id=second.id,
                        max_output_tokens=1, stream=True)
                    done = [e async for e in stream][-1]
                    assert done.type == "response.completed"
                    assert [m["content"] for m in e3.received[-1]["input"]] == [
                        "My name is Ada.", "Hello from", "What is my name?",
                        "Hello from the", "And again?"]
                    # the streamed turn is stored too: retrievable on another gateway
                    got = await oai(b).responses.retrieve(done.response.id)
                    assert got.output_text == "Hello"
            finally:
                await e3.stop()
            # another tenant cannot read or continue acme's conversation
            with pytest.raises(openai.NotFoundError):
                await oai(a, "other").responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError) as err:
                await oai(b).responses.create(model=e2.model, input="x",
                                              previous_response_id="resp_missing")
            assert err.value.body["param"] == "previous_response_id"
            with pytest.raises(openai.BadRequestError):
                await oai(b).responses.cancel(first.id)
            with pytest.raises(openai.NotFoundError):
                await oai(b).responses.cancel("resp_missing")
    finally:
        await e2.stop()


async def test_store_false_is_not_kept(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        r = await oai(gw).responses.create(model=engine.model, input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await oai(gw).responses.retrieve(r.id)


async def test_messages_non_stream_stream_count_tokens(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        client = claude(gw)
        before = await scrape(gw)
        msg = await client.messages.create(
            model=engine.model, max_tokens=3,
            messages=[{"role": "user", "content": "Hello"}])
        assert msg.content[0].text == "Hello from the"
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (7, 3)
        assert engine.headers[-1].get("x-api-key") is None  # the tenant's key stays here
        async with client.messages.stream(
                model=engine.model, max_tokens=2,
                messages=[{"role": "user", "content": "Hello"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello from" and final.usage.output_tokens == 2
        count = await client.messages.count_tokens(
            model=engine.model, messages=[{"role": "user", "content": "Hello"}])
        assert count.input_tokens == 7
        await gw.idle()
        after = await scrape(gw)

        def moved(**labels: str) -> float:
            return value(after, "sluice_tokens_total", **labels) - value(
                before, "sluice_tokens_total", **labels)

        assert moved(endpoint="messages", kind="completion") == 5
        assert moved(endpoint="messages", kind="prompt") == 14
        assert moved(endpoint="count_tokens") == 0  # requests/min only


async def test_messages_errors_in_anthropic_shape(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        with pytest.raises(anthropic.AuthenticationError) as err:
            await claude(gw, "nobody").messages.create(
                model=engine.model, max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert err.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": err.value.body["error"]["message"]}}
        with pytest.raises(anthropic.NotFoundError) as err:
            await claude(gw).messages.create(
                model="no-such-model", max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert err.value.body["error"]["type"] == "not_found_error"
        # max_tokens is required, as Anthropic's; anthropic-version is accepted
        r = await gw.post("/v1/messages", {"model": engine.model, "messages": [
            {"role": "user", "content": "x"}]}, headers={
            "x-api-key": "key-acme", "anthropic-version": "2023-06-01"})
        body = await r.json()
        assert r.status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]


async def test_embeddings_single_list_and_cache_hit(engines) -> None:
    [engine] = await engines(1, model="all-minilm-l6-v2")
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        client = oai(gw)
        one = await client.embeddings.create(model=engine.model, input="hello world")
        assert len(one.data) == 1 and one.usage.prompt_tokens == 2
        many = await client.embeddings.with_raw_response.create(
            model=engine.model, input=["a b", "c"], encoding_format="float")
        assert many.headers["x-sluice-cache"] == "miss"
        assert [d.index for d in many.parse().data] == [0, 1]
        await gw.idle()
        again = await client.embeddings.with_raw_response.create(
            model=engine.model, input=["a b", "c"], encoding_format="float")
        assert again.headers["x-sluice-cache"] == "hit-exact"
        assert again.parse().data[1].embedding == many.parse().data[1].embedding
        assert len(engine.received) == 2  # the repeat never reached the engine
        await gw.idle()
        m = await scrape(gw)
        assert value(m, "sluice_tokens_total", endpoint="embeddings", kind="prompt") == 5
        assert value(m, "sluice_cached_tokens_total", endpoint="embeddings",
                     kind="prompt") == 3


async def test_tokenize_detokenize(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        h = {"Authorization": "Bearer key-acme"}
        r = await gw.post("/tokenize", {"model": engine.model, "prompt": "hi"}, headers=h)
        assert r.status == 200 and (await r.json())["tokens"] == [104, 105]
        r = await gw.post("/detokenize", {"model": engine.model, "tokens": [104, 105]},
                          headers=h)
        assert (await r.json())["prompt"] == "hi"
        r = await gw.post("/tokenize", {"model": "nope", "prompt": "hi"}, headers=h)
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await gw.post("/tokenize", {"prompt": "hi"})
        assert r.status == 401


async def test_each_endpoint_429_with_retry_after_for_small_budget(engines) -> None:
    """A tenant with 60 tokens/min (one per endpoint, each its own minute): each
    request reserves its prompt + output cap and settles what the engine used; once
    the budget is spent the next is a 429 with Retry-After, in the endpoint's own
    error shape."""
    [engine] = await engines(1)
    [embed] = await engines(1, model="embedder")
    names = ["chat", "responses", "messages", "embeddings"]
    tenants = {"allow_anonymous": False,
               "tenants": [tenant(f"tiny-{n}", tokens_per_min=60) for n in names]}
    async with run_gateway(make_config([engine, embed], tenants=tenants)) as gw:
        calls = {
            "chat": lambda: oai(gw, "tiny-chat").chat.completions.create(
                model=engine.model, max_tokens=40, messages=[{"role": "user", "content": "hi"}]),
            "responses": lambda: oai(gw, "tiny-responses").responses.create(
                model=engine.model, input="hi", max_output_tokens=40),
            "messages": lambda: claude(gw, "tiny-messages").messages.create(
                model=engine.model, max_tokens=40, messages=[{"role": "user", "content": "hi"}]),
            "embeddings": lambda: oai(gw, "tiny-embeddings").embeddings.create(
                model=embed.model, input="x " * 50,  # not a cache hit: those cost nothing
                extra_headers={"Cache-Control": "no-cache"}),
        }
        for name, call in calls.items():
            await call()
            with pytest.raises((openai.RateLimitError, anthropic.RateLimitError)) as err:
                await call()
            assert int(err.value.response.headers["Retry-After"]) >= 1, name
            if name == "messages":
                assert err.value.body["error"]["type"] == "rate_limit_error"
            else:
                assert err.value.body["code"] == "rate_limit_exceeded"
        await gw.idle()
        m = await scrape(gw)
        for name in names:
            assert value(m, "sluice_tokens_total", endpoint=name, tenant=f"tiny-{name}") > 0


async def test_models_as_engines_describe_them(engines) -> None:
    two = await engines(2)
    async with run_gateway(make_config(two, tenants=TENANTS)) as gw:
        models = [m async for m in oai(gw).models.list()]
        assert len(models) == 1  # one entry per model, two engines serve it
        card = models[0].model_dump()
        assert card["id"] == two[0].model and card["owned_by"] == "vllm"
        assert card["created"] == 1700000000 and card["max_model_len"] == 2048
        assert card["root"] == f"/models/{two[0].model}"


async def test_stream_without_include_usage_keeps_fingerprint(engines) -> None:
    [engine] = await engines(1, system_fingerprint="fp_" + secrets.token_hex(4))
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        chunks = [c async for c in await oai(gw).chat.completions.create(
            model=engine.model, max_tokens=3, stream=True,
            messages=[{"role": "user", "content": "hi"}])]
        assert engine.received[-1]["stream_options"] == {"include_usage": True}
        assert all(c.choices for c in chunks)  # no usage chunk the client did not ask for
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].system_fingerprint == engine.system_fingerprint
        await gw.idle()
        m = await scrape(gw)
        assert value(m, "sluice_tokens_total", endpoint="chat", kind="completion") == 3
        # with include_usage the usage chunk carries it, as vLLM sends it
        chunks = [c async for c in await oai(gw).chat.completions.create(
            model=engine.model, max_tokens=3, stream=True, stream_options={
                "include_usage": True}, messages=[{"role": "user", "content": "hi"}])]
        assert chunks[-1].usage.completion_tokens == 3
        assert chunks[-1].system_fingerprint == engine.system_fingerprint


async def test_unknown_response_paths_are_404_in_openai_shape(engines) -> None:
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        r = await gw.session.get(gw.url + "/v1/responses/resp_x",
                                 headers={"Authorization": "Bearer key-acme"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_new_endpoints_retry_on_another_engine_before_the_first_byte(engines) -> None:
    """An engine answering 503 is passed over for the other one, for a streamed
    Responses request and an Anthropic Messages request alike."""
    busy, ok = await engines(2)
    busy.mode, busy.status = "status", 503
    async with run_gateway(make_config([busy, ok], tenants=TENANTS)) as gw:
        for _ in range(3):  # whichever engine the scheduler tries first
            events = [e async for e in await oai(gw).responses.create(
                model=ok.model, input="hi", max_output_tokens=2, stream=True)]
            assert events[-1].type == "response.completed"
            msg = await claude(gw).messages.create(
                model=ok.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert msg.usage.output_tokens == 2
        assert len(ok.received) == 6


async def test_engine_rejection_on_messages_is_anthropic_shaped(engines) -> None:
    [engine] = await engines(1, mode="status", status=400, error_message="bad tool schema")
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        with pytest.raises(anthropic.BadRequestError) as err:
            await claude(gw).messages.create(
                model=engine.model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert err.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "bad tool schema"}}


async def test_deterministic_responses_are_cache_hits_and_chain_on(engines) -> None:
    """A temperature-0 Response repeated is answered from the cache, as JSON and as
    the Responses events (the SDK parses both), with a new id that a follow-up can
    name in ``previous_response_id``; a sampled one (no temperature) never is."""
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        client = oai(gw).responses.with_raw_response
        ask = {"model": engine.model, "input": "Capital of France?", "temperature": 0,
               "max_output_tokens": 4}
        first = await client.create(**ask, stream=True)  # made as a stream, stored whole
        made = [e async for e in first.parse()][-1].response
        assert first.headers["x-sluice-cache"] == "miss"
        await gw.idle()
        again = await client.create(**ask)
        assert again.headers["x-sluice-cache"] == "hit-exact"
        hit = again.parse()
        assert hit.output_text == made.output_text == "Hello from the fake"
        assert hit.id != made.id and hit.usage.input_tokens_details.cached_tokens == 7
        streamed = await client.create(**ask, stream=True)
        assert streamed.headers["x-sluice-cache"] == "hit-exact"
        events = [e async for e in streamed.parse()]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
            == "Hello from the fake"
        assert events[-1].type == "response.completed"
        assert len(engine.received) == 1  # both repeats were answered by the gateway
        follow = await oai(gw).responses.create(
            model=engine.model, input="And Spain?", previous_response_id=hit.id,
            max_output_tokens=2)
        assert follow.status == "completed"
        assert [m["content"] for m in engine.received[-1]["input"]] == [
            "Capital of France?", "Hello from the fake", "And Spain?"]
        sampled = {k: v for k, v in ask.items() if k != "temperature"}
        for _ in range(2):
            r = await client.create(**sampled)
            assert r.headers["x-sluice-cache"] == "bypass"
        assert len(engine.received) == 4


async def test_deterministic_messages_are_cache_hits_as_json_and_as_a_stream(engines) -> None:
    """A temperature-0 Anthropic message repeated is answered from the cache; the
    SDK's stream helper rebuilds the same message from the replayed events, its input
    counted as read from the cache; a hit charges no tokens. (The anthropic SDK no
    longer has a ``temperature`` argument: a client sends it in the body, which vLLM
    reads.)"""
    [engine] = await engines(1)
    async with run_gateway(make_config([engine], tenants=TENANTS)) as gw:
        client = claude(gw)
        ask = {"model": engine.model, "max_tokens": 3, "extra_body": {"temperature": 0},
               "messages": [{"role": "user", "content": "Hello"}]}
        made = await client.messages.create(**ask)
        await gw.idle()
        before = await scrape(gw)
        again = await client.messages.with_raw_response.create(**ask)
        assert again.headers["x-sluice-cache"] == "hit-exact"
        hit = await again.parse()
        assert hit.content[0].text == made.content[0].text == "Hello from the"
        assert hit.id != made.id and hit.stop_reason == "end_turn"
        assert (hit.usage.input_tokens, hit.usage.cache_read_input_tokens,
                hit.usage.output_tokens) == (0, 7, 3)
        async with client.messages.stream(**ask) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello from the" and final.usage.output_tokens == 3
        assert len(engine.received) == 1
        await gw.idle()
        after = await scrape(gw)
        assert value(after, "sluice_tokens_total", endpoint="messages", kind="completion") \
            == value(before, "sluice_tokens_total", endpoint="messages", kind="completion")
        assert value(after, "sluice_requests_total", endpoint="messages",
                     outcome="cache_hit") == 2
