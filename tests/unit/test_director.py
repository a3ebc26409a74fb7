"""The Director's orchestration, one test per outcome, without HTTP or real time.

Real parts: the RateLimiter over the memory store, the AdmissionQueue, the Scheduler,
the SaturationDetector, the engine pool and the response cache (memory store), all on
a hand-driven clock. The one fake is the engine client (:class:`FakeClient`, the same
``send`` signature and :class:`ProxyResult` as ``gateway.proxy.EngineClient``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import StreamReader, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.test_utils import make_mocked_request

from cache.service import open_cache
from config.schema import (
    CacheConfig,
    Config,
    EnginesConfig,
    GatewayConfig,
    TenantQuota,
    TenantsConfig,
)
from engines.blocks import fallback_tokenize
from engines.pool import Engine, EnginePool, EngineState, MetricsSnapshot
from engines.prompt import render_fallback_chat
from engines.scheduler import Scheduler
from gateway.director import Director
from gateway.keys import RECORD, TENANT
from gateway.openai_api import InferenceRequest
from gateway.proxy import ProxyResult, UpstreamFailed
from gateway.record import RequestRecord
from limits.admission import AdmissionQueue
from limits.memory_store import MemoryStore
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter
from limits.saturation import SaturationDetector, kv_blocks
from tests.support import ManualClock as Clock
from tests.support import wait_for

MSG = [{"role": "user", "content": "hello there"}]


class FakeClient:
    """``EngineClient.send``'s contract: per engine id, either an exception to raise
    (``UpstreamFailed`` before the first byte), an ``asyncio.Event`` to wait on
    (a slow engine), a list of those consumed one per call, or nothing: answer with
    ``completion`` tokens."""

    def __init__(self, completion: int = 5, **behaviour: Any) -> None:
        self.completion = completion
        self.behaviour = behaviour
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.priorities: list[int | None] = []
        self.entered = asyncio.Event()

    async def send(self, engine: Engine, req: InferenceRequest, request: web.Request,
                   response_headers: Any, upstream_headers: Any = None,
                   on_first_token: Any = None, priority: int | None = None,
                   on_answer: Any = None) -> ProxyResult:
        self.calls.append((engine.id, dict(req.body)))
        self.priorities.append(priority)
        self.entered.set()
        action = self.behaviour.get(engine.id)
        if isinstance(action, list):
            action = action.pop(0) if action else None
        if isinstance(action, BaseException):
            raise action
        if isinstance(action, asyncio.Event):
            await action.wait()
        if on_first_token is not None:
            on_first_token()
        answer = {"id": "x", "object": "chat.completion", "model": req.model,
                  "choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": "hi"}}],
                  "usage": {"prompt_tokens": req.prompt_tokens,
                            "completion_tokens": self.completion}}
        return ProxyResult(Outcome.OK, web.json_response(answer, headers=response_headers),
                           req.prompt_tokens, self.completion, 0.01, answer, ["stop"])


def payload(raw: bytes) -> StreamReader:
    """A request body as aiohttp's own stream, already complete."""
    loop = asyncio.get_running_loop()
    reader = StreamReader(BaseProtocol(loop), 2**16, loop=loop)
    reader.feed_data(raw)
    reader.feed_eof()
    return reader


def config(engines: int = 2, *, gateway: dict[str, Any] | None = None,
           engines_extra: dict[str, Any] | None = None) -> Config:
    specs = [{"name": f"e{i}", "model": "m", "kind": "sim"} for i in range(engines)]
    specs.append({"name": "s0", "model": "small", "kind": "sim"})
    return Config(
        gateway=GatewayConfig.model_validate({"default_output_tokens": 100, **(gateway or {})}),
        engines=EnginesConfig.model_validate({"engines": specs, **(engines_extra or {})}),
        tenants=TenantsConfig.model_validate({"allow_anonymous": True}),
    )


class Harness:
    def __init__(self, cfg: Config, client: FakeClient, clock: Clock | None = None,
                 cache: bool = False) -> None:
        self.clock = clock or Clock()
        self.pool = EnginePool([Engine(s.name, s.model, "http://127.0.0.1:1")
                                for s in cfg.engines.engines])
        for e in self.pool.engines:
            self.pool.set_state(e, EngineState.READY)
            self.pool.set_metrics(e, MetricsSnapshot(at=self.clock.t, kv_cache_usage=0.1,
                                                     block_size=16, num_blocks=1000))
        self.limiter = RateLimiter(MemoryStore(self.clock))
        self.queues = {m: AdmissionQueue(m, cfg.gateway.queue, self.clock)
                       for m in cfg.engines.model_names()}
        self.client = client
        self.cache = open_cache(CacheConfig(semantic={"enabled": False})) if cache else None
        self.director = Director(
            cfg=cfg, pool=self.pool, scheduler=Scheduler(cfg.engines.scheduler),
            client=client, limiter=self.limiter,  # type: ignore[arg-type]
            queues=self.queues, detector=SaturationDetector.from_config(cfg.engines),
            cache=self.cache, clock=self.clock)

    async def run(self, body: dict[str, Any], tenant: TenantQuota | None = None,
                  endpoint: str = "chat", headers: dict[str, str] | None = None,
                  ) -> tuple[RequestRecord, web.StreamResponse | Rejected]:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        request = make_mocked_request("POST", path, headers=headers or {},
                                      payload=payload(json.dumps(body).encode()))
        rec = RequestRecord(request_id="r")
        request[TENANT] = tenant or TenantQuota(name="acme")
        request[RECORD] = rec
        try:
            return rec, await self.director.handle(request, endpoint)  # type: ignore[arg-type]
        except Rejected as e:
            rec.outcome = e.outcome
            return rec, e

    def assert_nothing_held(self) -> None:
        assert [(e.in_flight, e.promised_blocks) for e in self.pool.engines] == \
            [(0, 0)] * len(self.pool.engines)
        assert self.limiter.open_reservations == 0 and self.limiter.held_slots == 0
        assert all(len(q) == 0 and q.tokens_queued == 0 for q in self.queues.values())


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


async def test_success_reserves_exact_prompt_plus_cap_and_settles_real_usage() -> None:
    h = Harness(config(), FakeClient(completion=7))
    t = TenantQuota(name="acme", tokens_per_min=1000, max_concurrent=1)
    rec, resp = await h.run(chat(max_tokens=50), t)
    assert isinstance(resp, web.Response) and resp.status == 200
    assert rec.outcome is Outcome.OK and rec.engine in ("e0", "e1")
    assert rec.reserved_output_tokens == 50 and rec.completion_tokens == 7
    assert rec.overshoot_tokens == 0 and rec.queue_s == 0.0
    # the prompt was tokenized as the simulator does (exact, not characters/4)
    assert rec.prompt_tokens == len(fallback_tokenize(render_fallback_chat(MSG)))
    h.assert_nothing_held()
    # settled with the real usage: the bucket holds 1000 − (prompt + 7)
    big = 1000 - rec.prompt_tokens - 7
    rec2, resp2 = await h.run(chat(max_tokens=big - rec.prompt_tokens), t)
    assert rec2.outcome is Outcome.OK


async def test_cache_hit_answers_without_an_engine_and_reserves_no_tokens() -> None:
    h = Harness(config(), FakeClient(completion=3), cache=True)
    rec, _ = await h.run(chat(max_tokens=10, temperature=0))
    assert rec.outcome is Outcome.OK and rec.cache == "miss"
    for task in list(h.director.cache._background):
        await task
    rec, resp = await h.run(chat(max_tokens=10, temperature=0))
    assert rec.outcome is Outcome.CACHE_HIT and rec.cache == "hit-exact"
    assert rec.reserved_output_tokens is None and rec.completion_tokens == 3
    assert len(h.client.calls) == 1 and isinstance(resp, web.Response)
    h.assert_nothing_held()


async def test_rate_limited_is_a_retryable_429() -> None:
    h = Harness(config(), FakeClient())
    t = TenantQuota(name="acme", requests_per_min=1)
    assert (await h.run(chat(max_tokens=5), t))[0].outcome is Outcome.OK
    rec, e = await h.run(chat(max_tokens=5), t)
    assert isinstance(e, Rejected) and e.outcome is Outcome.RATE_LIMITED
    assert e.reason == "requests_per_min" and e.retry_after_s == pytest.approx(60)
    h.assert_nothing_held()


async def test_no_cap_on_a_small_quota_is_admitted_not_refused_forever() -> None:
    h = Harness(config(gateway={"default_output_tokens": 1024}), FakeClient(completion=20))
    t = TenantQuota(name="acme", tokens_per_min=200)
    rec, resp = await h.run(chat(), t)
    assert rec.outcome is Outcome.OK, resp
    assert rec.reserved_output_tokens == 200 - rec.prompt_tokens
    sent = h.client.calls[0][1]  # the engine stops where the reservation does
    assert sent.get("max_completion_tokens", sent.get("max_tokens")) == 200 - rec.prompt_tokens
    assert rec.overshoot_tokens == 0
    h.assert_nothing_held()


async def test_never_fits_is_a_400_naming_the_field_without_retry_after() -> None:
    h = Harness(config(), FakeClient())
    t = TenantQuota(name="acme", tokens_per_min=200)
    rec, e = await h.run(chat(max_completion_tokens=20, n=10), t)
    assert isinstance(e, Rejected) and e.outcome is Outcome.EXCEEDS_QUOTA
    assert e.outcome.status == 400 and e.retry_after_s is None
    assert e.param == "max_completion_tokens" and not h.client.calls
    h.assert_nothing_held()


async def test_n_multiplies_the_reservation() -> None:
    h = Harness(config(engines=1), FakeClient(completion=500))
    t = TenantQuota(name="acme", tokens_per_min=1000)
    rec, _ = await h.run(chat(max_tokens=50, n=10), t)
    assert rec.outcome is Outcome.OK
    assert rec.reserved_output_tokens == 500 and rec.overshoot_tokens == 0
    h.assert_nothing_held()


async def held_blocks(h: Harness, body: dict[str, Any], endpoint: str = "chat") -> int:
    """KV blocks promised while ``body`` is in flight on the only engine."""
    gate = asyncio.Event()
    h.client.behaviour["e0"] = gate
    task = asyncio.ensure_future(h.run(body, endpoint=endpoint))
    await h.client.entered.wait()
    blocks = h.pool.engines[0].promised_blocks
    assert h.pool.engines[0].in_flight == 1
    gate.set()
    rec, _ = await task
    assert rec.outcome is Outcome.OK
    h.assert_nothing_held()
    return blocks


async def test_kv_lease_counts_every_sequence() -> None:
    h = Harness(config(engines=1), FakeClient())
    prompt = len(fallback_tokenize(render_fallback_chat(MSG)))
    assert await held_blocks(h, chat(max_tokens=160, n=10)) == kv_blocks(prompt + 1600, 16)


async def test_completions_prompt_list_counts_every_prompt_and_reads_max_tokens() -> None:
    h = Harness(config(engines=1), FakeClient())
    body = {"model": "m", "prompt": ["a b c"] * 8, "max_tokens": 16, "max_completion_tokens": 1}
    # 8 prompts of ~2 estimated tokens, 16 output tokens each (max_tokens, which vLLM reads)
    assert await held_blocks(h, body, "completions") == kv_blocks(8 * 2 + 8 * 16, 16)
    assert h.client.calls[0][1]["max_tokens"] == 16


async def test_shed_when_saturated_past_the_ladder() -> None:
    cfg = config(engines=1, engines_extra={"saturation": {"max_in_flight": 1},
                                           "models": [{"name": "m"}]})
    h = Harness(cfg, FakeClient())
    gate = asyncio.Event()
    h.client.behaviour["e0"] = gate
    holder = asyncio.ensure_future(h.run(chat(max_tokens=5), TenantQuota(name="i",
                                                                       priority="interactive")))
    await h.client.entered.wait()
    waiting = asyncio.ensure_future(h.run(chat(max_tokens=5), TenantQuota(name="b",
                                                                        priority="batch")))
    await wait_for(lambda: len(h.queues["m"]) == 1, what="the batch request to queue")
    rec, e = await h.run(chat(max_tokens=5), TenantQuota(name="s", max_queue_wait_s=0.001))
    assert isinstance(e, Rejected) and e.outcome is Outcome.OVERLOADED and e.reason == "shed"
    gate.set()
    assert (await holder)[0].outcome is Outcome.OK
    assert (await waiting)[0].outcome is Outcome.OK
    h.assert_nothing_held()


async def test_queue_timeout_when_no_engine_has_room_by_the_deadline() -> None:
    cfg = config(engines=1, engines_extra={"saturation": {"max_in_flight": 1}})
    clock = Clock()
    h = Harness(cfg, FakeClient(), clock)
    lease = h.pool.lease(h.pool.engines[0])  # the only slot is taken
    for e in h.pool.engines:  # metrics stay fresh while the clock moves
        h.pool.set_metrics(e, MetricsSnapshot(at=1e9, kv_cache_usage=0.1))
    clock.step = 1.0  # every read of the clock moves it 1 s: the 0.5 s deadline passes
    rec, e = await h.run(chat(max_tokens=5), TenantQuota(name="acme", max_queue_wait_s=0.5,
                                                          priority="interactive"))
    assert isinstance(e, Rejected) and e.outcome is Outcome.QUEUE_TIMEOUT
    lease.release()
    lease.release()  # idempotent: the slot comes back once
    h.assert_nothing_held()


async def test_degraded_caps_output_then_falls_back() -> None:
    cfg = config(engines=1, engines_extra={
        "saturation": {"max_in_flight": 1},
        "models": [{"name": "m", "degradation": {"max_tokens_cap": 8,
                                                 "fallback_model": "small"}}]})
    h = Harness(cfg, FakeClient())
    lease = h.pool.lease(h.pool.engines[0])  # "m" has no room
    rec, resp = await h.run(chat(max_completion_tokens=500, max_tokens=900))
    assert rec.outcome is Outcome.OK and rec.engine == "s0"
    assert rec.degraded == ("max_completion_tokens=8", "model=small")
    sent = h.client.calls[0][1]
    assert sent["model"] == "small" and sent["max_completion_tokens"] == 8
    assert "max_tokens" not in sent
    lease.release()
    h.assert_nothing_held()


async def test_retry_on_another_engine_before_the_first_byte() -> None:
    first_call_fails: list[Any] = [UpstreamFailed(Outcome.UPSTREAM_ERROR, "boom",
                                                  retryable=True)]  # shared by both engines
    h = Harness(config(), FakeClient(e0=first_call_fails, e1=first_call_fails))
    rec, resp = await h.run(chat(max_tokens=5))
    first, second = (c[0] for c in h.client.calls)
    assert first != second and rec.outcome is Outcome.OK and rec.engine == second
    h.assert_nothing_held()


async def test_all_engines_fail() -> None:
    failing = UpstreamFailed(Outcome.UPSTREAM_ERROR, "boom", retryable=True)
    h = Harness(config(), FakeClient(e0=failing, e1=failing))
    rec, e = await h.run(chat(max_tokens=5))
    assert isinstance(e, Rejected) and e.outcome is Outcome.UPSTREAM_ERROR
    assert sorted(c[0] for c in h.client.calls) == ["e0", "e1"]
    h.assert_nothing_held()


async def test_non_retryable_failure_is_not_retried() -> None:
    timeout = UpstreamFailed(Outcome.UPSTREAM_TIMEOUT, "slow", retryable=False)
    h = Harness(config(), FakeClient(e0=timeout, e1=timeout))
    rec, e = await h.run(chat(max_tokens=5))
    assert isinstance(e, Rejected) and e.outcome is Outcome.UPSTREAM_TIMEOUT
    assert len(h.client.calls) == 1
    h.assert_nothing_held()


async def test_client_cancelled_releases_everything() -> None:
    h = Harness(config(engines=1), FakeClient(e0=asyncio.Event()))
    t = TenantQuota(name="acme", tokens_per_min=1000, max_concurrent=1)
    task = asyncio.ensure_future(h.run(chat(max_tokens=50), t))
    await h.client.entered.wait()
    assert h.pool.engines[0].in_flight == 1 and h.limiter.held_slots == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    h.assert_nothing_held()




async def test_band_forwarded_as_priority_only_to_priority_scheduling_engines() -> None:
    h = Harness(config(engines=2), FakeClient())
    h.pool.get("e0").priority_scheduling = True
    seen: dict[str, set[int | None]] = {"e0": set(), "e1": set()}
    sent = 0
    while (len(seen["e0"]) < 2 or not seen["e1"]) and sent < 400:  # idle engines: random pick
        for name, prio in (("chat", "interactive"), ("bulk", "batch")):
            rec, _ = await h.run(chat(max_tokens=5, priority=-7),
                                 TenantQuota(name=name, priority=prio))
            assert rec.outcome is Outcome.OK
            seen[rec.engine].add(h.client.priorities[-1])
            sent += 1
    assert seen == {"e0": {0, 2}, "e1": {None}}  # never to e1, never the client's
    h.assert_nothing_held()


async def test_a_request_whose_ttft_target_has_passed_is_shed_as_predicted_miss() -> None:
    from limits.latency_model import LatencyPrior
    clock = Clock()
    h = Harness(config(engines=1), FakeClient(), clock)
    lat = h.director.gate.ledger("e0")
    assert lat is not None
    # a trusted model: 50 ms + 1 ms per prefill token
    lat.model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                    rel_std=1e-6), min_samples=0)
    lat.model.tpot_rel_error = 0.0
    assert lat.model.confident
    # time passes while the request is read: 0.99 s of the interactive 1 s target
    clock.step = 0.33
    rec, e = await h.run(chat(max_tokens=5), TenantQuota(name="chat", priority="interactive"))
    assert isinstance(e, Rejected) and e.outcome is Outcome.OVERLOADED
    assert e.reason == "predicted_miss" and e.retry_after_s >= 1
    assert h.client.calls == []
    clock.step = 0.0
    # the engine's metrics scraped again (the shed request's clock reads aged them)
    h.pool.set_metrics(h.pool.get("e0"), MetricsSnapshot(at=clock.t, kv_cache_usage=0.1,
                                                         block_size=16, num_blocks=1000))
    rec, _ = await h.run(chat(max_tokens=5), TenantQuota(name="chat", priority="interactive"))
    assert rec.outcome is Outcome.OK
    h.assert_nothing_held()


async def test_an_engine_too_slow_for_the_slo_takes_what_the_others_cannot_serve_in_time() -> None:
    from limits.latency_model import LatencyPrior
    clock = Clock()
    h = Harness(config(engines=2), FakeClient(), clock)
    for name, step_s in (("e0", 0.02), ("e1", 0.2)):  # e1: TPOT 200 ms alone > 100 ms
        lat = h.director.gate.ledger(name)
        assert lat is not None
        lat.model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                        step_s=step_s, rel_std=1e-6), min_samples=0)
        lat.model.tpot_rel_error = 0.0
        lat.model.observe_tpot(step_s + 0.003, 1.0, 0.0, 10)  # seen decoding alone
    assert h.director.gate.ledger("e1").mode(0.1) == "best_effort"
    assert h.director.gate.ledger("e0").mode(0.1) == "model"
    chat_tenant = TenantQuota(name="chat", priority="interactive")
    for _ in range(10):  # in time: always the engine that meets the SLO
        rec, _ = await h.run(chat(max_tokens=5), chat_tenant)
        assert rec.outcome is Outcome.OK and rec.engine == "e0"
    # too late for e0's TTFT target: served at best effort on e1, not shed
    clock.step = 0.33
    rec, _ = await h.run(chat(max_tokens=5), chat_tenant)
    assert rec.outcome is Outcome.OK and rec.engine == "e1"
    # but not behind 10,000 prefill tokens queued there (TTFT̂ ~10 s): best effort
    # keeps the TTFT rule, so the request is shed rather than sent to start that late
    e1 = h.director.gate.ledger("e1")
    e1.pending_prefill_tokens += 10_000
    h.pool.set_metrics(h.pool.get("e0"), MetricsSnapshot(
        at=clock.t, kv_cache_usage=0.1, block_size=16, num_blocks=1000))
    h.pool.set_metrics(h.pool.get("e1"), MetricsSnapshot(
        at=clock.t, kv_cache_usage=0.1, block_size=16, num_blocks=1000))
    rec, e = await h.run(chat(max_tokens=5), chat_tenant)
    assert isinstance(e, Rejected) and e.reason == "predicted_miss"
    e1.pending_prefill_tokens -= 10_000
    # and with e1 gone, shed as before (fresh metrics for e0: the clock moved on)
    h.pool.set_state(h.pool.get("e1"), EngineState.DRAINING)
    h.pool.set_metrics(h.pool.get("e0"), MetricsSnapshot(
        at=clock.t, kv_cache_usage=0.1, block_size=16, num_blocks=1000))
    rec, e = await h.run(chat(max_tokens=5), chat_tenant)
    assert isinstance(e, Rejected) and e.reason == "predicted_miss"
    h.assert_nothing_held()


async def test_a_lone_best_effort_engine_takes_requests_behind_any_queued_prefill() -> None:
    """With no engine that meets the SLO, holding a request back from the best-effort
    one would only move its wait to the gateway's queue: the TTFT rule does not apply."""
    from limits.latency_model import LatencyPrior
    clock = Clock()
    h = Harness(config(engines=1), FakeClient(), clock)
    lat = h.director.gate.ledger("e0")
    assert lat is not None
    lat.model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                    step_s=0.2, rel_std=1e-6), min_samples=0)
    lat.model.tpot_rel_error = 0.0
    lat.model.observe_tpot(0.203, 1.0, 0.0, 10)  # seen decoding alone: 200 ms > 100 ms
    assert lat.mode(0.1) == "best_effort"
    lat.pending_prefill_tokens += 10_000  # TTFT̂ ~10 s against the 1 s target
    rec, _ = await h.run(chat(max_tokens=5), TenantQuota(name="chat", priority="interactive"))
    assert rec.outcome is Outcome.OK and rec.engine == "e0"
    lat.pending_prefill_tokens -= 10_000
    h.assert_nothing_held()


async def test_upstream_body_carries_the_band_never_the_clients_priority() -> None:
    import aiohttp

    from config.schema import Timeouts
    from gateway.openai_api import parse_request
    from gateway.proxy import EngineClient

    async with aiohttp.ClientSession() as session:
        client = EngineClient(session=session, timeouts=Timeouts(), max_event_bytes=1 << 20,
                              clock=Clock())
        req = parse_request("chat", chat(max_tokens=5, priority=-7))
        assert "priority" not in json.loads(client._upstream_body(req, None))
        assert json.loads(client._upstream_body(req, 2))["priority"] == 2
