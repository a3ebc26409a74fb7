"""The per-request pipeline: orchestrates the steps of docs/architecture.md, "One
request", each of which is owned by another module.

Everything a request acquires (rate-limit reservation, concurrency slot, engine lease
and its promised KV blocks) is held by an ``async with`` and released exactly once,
whether it ends in success, error, timeout or client disconnect. Engine choice and
leases live in :mod:`gateway.placement`; this module orchestrates.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable

from aiohttp import web
from opentelemetry.trace import SpanKind

from cache.conversations import ResponseStore, input_items
from cache.policy import request_cacheable
from cache.replay import as_json, as_sse
from cache.service import STORE_ERRORS, CacheHit, CacheRequest, ResponseCache
from cache.stores import MemoryByteStore
from config.schema import PRIORITIES, Config, DegradationConfig, EnginesConfig, TenantQuota
from engines.kinds import accepts_cache_salt
from engines.pool import Engine, EnginePool
from engines.prompt import PromptBlocks, cache_salt
from engines.scheduler import SchedRequest, Scheduler
from engines.sessions import session_key
from gateway.capacity import CapacityReport
from gateway.disagg import Disaggregator, PrefillLeg
from gateway.keys import RECORD, TENANT
from gateway.openai_api import (
    TOKEN_FREE,
    Endpoint,
    InferenceRequest,
    output_cap,
    parse_json,
    parse_request,
    prompt_count,
)
from gateway.placement import Need, Placement, Placer
from gateway.prefill_queue import LegShed
from gateway.proxy import SSE_HEADERS, ClientGone, EngineClient, ProxyResult, UpstreamFailed
from gateway.record import RequestRecord
from gateway.tracing import Spans, inject_traceparent
from limits import capacity
from limits.admission import AdmissionQueue
from limits.degrade import DEGRADED_HEADER, ladder, shed
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter, Reservation, Sizing, reservation_size
from limits.saturation import SaturationDetector

log = logging.getLogger("sluice.director")

#: Endpoints the response cache serves (the others' answers are sampled text whose
#: streams it cannot replay, or cost nothing to recompute).
CACHED_ENDPOINTS = frozenset({"chat", "completions", "embeddings"})
#: Request fields whose output a streamed answer, reassembled, would not keep
#: (``StreamSummary.to_response`` rebuilds every delta field, not the per-token
#: ``logprobs``): such answers are not cached.
STREAM_LOSSY = frozenset({"logprobs", "top_logprobs"})

#: Retry-After, s, when no engine serving the model is ready (engines restart with
#: backoff starting at 1 s; a few seconds is the honest order of magnitude).
NO_ENGINE_RETRY_S = 5
#: Response header naming a split request's prefill engine (``x-sluice-engine``
#: names the engine that streamed the answer).
PREFILL_ENGINE_HEADER = "x-sluice-prefill-engine"
#: Response header: prompt tokens the prefix index predicted cached on the chosen
#: engine, per index (``events=N, approximate=M``); the replay benchmark compares it
#: with the engine's ``usage.prompt_tokens_details.cached_tokens``.
PREFIX_TOKENS_HEADER = "x-sluice-prefix-tokens"


def _request_timeout(request: web.Request) -> float | None:
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise Rejected(Outcome.INVALID_REQUEST, "x-request-timeout must be a positive number "
                       "of seconds.", param="x-request-timeout")
    return value


def _call_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()


def _split_models(engines: EnginesConfig) -> frozenset[str]:
    """Models with prefill engines (prefill–decode disaggregation)."""
    return frozenset(s.model for s in engines.engines if s.role == "prefill")


def _salted_models(engines: EnginesConfig) -> set[str]:
    """Models whose every engine accepts vLLM's ``cache_salt`` (when enabled)."""
    return {m for m in engines.model_names()
            if engines.scheduler.prefix.cache_salt
            and all(accepts_cache_salt(s) for s in engines.engines if s.model == m)}


def _gone(model: str) -> Rejected:
    return Rejected(Outcome.MODEL_NOT_FOUND,
                    f"The model '{model}' is no longer served.", param="model")


def _cache_control(request: web.Request) -> tuple[bool, bool]:
    """(no_cache, no_store) from ``Cache-Control``."""
    tokens = {t.strip().lower() for t in request.headers.get("Cache-Control", "").split(",")}
    return "no-cache" in tokens, "no-store" in tokens


class Director:
    """Runs requests through the pipeline; one per app. Keyword-only.

    Args:
        cfg: the whole configuration.
        pool: the engines.
        scheduler: engine choice (routing state, plugins).
        client: the upstream call.
        limiter: per-tenant rate limits and concurrency.
        queues: one admission queue per served model.
        detector: whether an engine has room (saturation).
        cache: the response cache, or None when disabled.
        clock: monotonic time, s; the only clock the request path reads.
        spans: tracing (disabled when None).
        prompts: tokenizer and block hashes per model (built from ``cfg`` when None).
        responses: the Responses API's stored conversations (``previous_response_id``);
            None: in this process's memory.
    """

    def __init__(self, *, cfg: Config, pool: EnginePool, scheduler: Scheduler,
                 client: EngineClient, limiter: RateLimiter,
                 queues: dict[str, AdmissionQueue[Placement]], detector: SaturationDetector,
                 cache: ResponseCache | None, clock: Clock, spans: Spans | None = None,
                 prompts: PromptBlocks | None = None,
                 responses: ResponseStore | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.client = client
        self.limiter = limiter
        self.queues = queues
        self.cache = cache
        self.clock = clock
        self.slo = cfg.gateway.slo
        self.adaptive = cfg.engines.saturation.adaptive
        #: prefill–decode disaggregation, for models with prefill engines
        self.split_models = _split_models(cfg.engines)
        disagg = Disaggregator(cfg.engines.disaggregation, clock, tpot_target_s=min(
            self.slo.target(p).tpot_s for p in PRIORITIES))
        self.placer = Placer(pool=pool, scheduler=scheduler, detector=detector, clock=clock,
                             disagg=disagg, split_models=self.split_models,
                             slo=self.slo, adaptive=self.adaptive,
                             retry_after=lambda m: self.queues[m].retry_after_s())
        #: per model, the mix of finished requests (the capacity report)
        self.mix = {m: capacity.MixTracker() for m in queues}
        self.capacity = CapacityReport(pool=pool, placer=self.placer, mix=self.mix,
                                       slo=self.slo, adaptive=self.adaptive)
        #: each served model's degradation ladder (model_settings builds a pydantic
        #: object per call, too costly per request)
        self._degradation: dict[str, DegradationConfig] = {
            m: cfg.engines.model_settings(m).degradation for m in queues}
        self.spans = spans or Spans(None)
        self.prefill_leg = PrefillLeg(client, disagg, self.spans)
        self.prompts = prompts or PromptBlocks(cfg.engines, pool)
        #: models whose every engine accepts vLLM's ``cache_salt``
        self._salted = _salted_models(cfg.engines)
        self.default_output_tokens = cfg.gateway.default_output_tokens
        self._background: set[asyncio.Task[object]] = set()
        self.responses = responses or ResponseStore(
            MemoryByteStore(cfg.gateway.cache.max_bytes, clock), cfg.gateway.cache.responses_ttl_s)

    # ------------------------------------------------------------------ reload

    def set_engines(self, engines: EnginesConfig) -> None:
        """Serve what a reloaded ``engines.yaml`` describes (as
        :func:`gateway.reload.reloadable_engines` returns it): an admission queue per
        model (a new model gets one; a model no longer served loses it — requests for
        it then get 404 ``model_not_found``, and so do those still queued), each
        model's degradation ladder, prompt encoder, ``cache_salt`` and split choice,
        the scheduler's plugins and the saturation thresholds. The engines
        themselves come and go through the pool (:meth:`engine_added`,
        :meth:`engine_removed`)."""
        self.cfg = self.cfg.model_copy(update={"engines": engines})
        models = engines.model_names()
        for model in set(self.queues) - set(models):
            self.queues.pop(model).close(functools.partial(_gone, model))
            del self.mix[model]
            self.placer.demand.pop(model, None)
        served = {m: self.queues.get(m) or AdmissionQueue(
            model=m, config=self.cfg.gateway.queue, clock=self.clock) for m in models}
        self.queues.clear()  # shared with the metrics and the stats feed: same dict
        self.queues.update(served)
        for model in models:
            self.mix.setdefault(model, capacity.MixTracker())
        self._degradation = {m: engines.model_settings(m).degradation for m in models}
        self.split_models = self.placer.split_models = _split_models(engines)
        self._salted = _salted_models(engines)
        self.prompts.set_engines(engines)
        self.placer.scheduler.set_plugins(engines.scheduler)
        self.placer.detector = SaturationDetector.from_config(engines)

    def engine_added(self, engine: Engine) -> None:
        """``engine`` joined the pool (:attr:`EnginePool.on_add`): its latency ledger."""
        self.placer.track(engine)

    def engine_removed(self, engine: Engine) -> None:
        """``engine`` left the pool (:attr:`EnginePool.on_remove`): its prefix-index
        entries and prefill-speed estimate go."""
        self.placer.scheduler.index.forget(engine.id)
        self.placer.forget(engine)

    # ------------------------------------------------------------------ checks

    def _check_model(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        allowed = tenant.allowed_models
        if req.model not in self.queues or (allowed is not None and req.model not in allowed):
            raise Rejected(
                Outcome.MODEL_NOT_FOUND,
                f"The model '{req.model}' does not exist or you do not have access to it.",
                param="model",
            )

    def _check_sequences(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        """At most ``gateway.max_sequences`` (or the tenant's lower ``max_sequences``)
        sequences per request (prompts × max(n, best_of)), before any work on it.

        Raises:
            Rejected: 400 ``invalid_request`` naming ``prompt`` when the prompts alone
                exceed it, else ``n`` or ``best_of`` (whichever is larger)."""
        limit = min(self.cfg.gateway.max_sequences, tenant.max_sequences or math.inf)
        total = req.sequences
        if total <= limit:
            return
        prompts = prompt_count(req.endpoint, req.body)
        n, best_of = req.body.get("n") or 1, req.body.get("best_of") or 1
        param = "prompt" if prompts > limit else ("best_of" if best_of > n else "n")
        raise Rejected(
            Outcome.INVALID_REQUEST,
            f"This request asks for {total} sequences ({prompts} prompt(s) × "
            f"{max(n, best_of)} per prompt, the larger of 'n' and 'best_of'); at most "
            f"{int(limit)} are allowed per request.", param=param)

    def _apply_tenant_caps(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        if tenant.max_prompt_tokens is not None and req.prompt_tokens > tenant.max_prompt_tokens:
            about = "" if req.prompt_exact else "about "
            raise Rejected(
                Outcome.CONTEXT_LENGTH_EXCEEDED,
                f"This request's prompt is {about}{req.prompt_tokens} tokens; your limit is "
                f"{tenant.max_prompt_tokens} tokens.",
                param=req.prompt_param,
            )
        cap = tenant.max_output_tokens
        if cap is None:
            return
        asked = req.max_output_tokens
        if asked is None:
            req.set_output_cap(cap)
        elif asked > cap:
            raise Rejected(
                Outcome.INVALID_REQUEST,
                f"'{req.output_field}' is {asked}; your limit is {cap} tokens.",
                param=req.output_field,
            )

    def _kv_tokens(self, req: InferenceRequest) -> int:
        """KV-cache tokens ``req`` may occupy: prompt + output cap (or the default) ×
        sequences; sizes the queue ticket, the KV-block lease and the context check."""
        return req.prompt_tokens + self._output_cap(req) * req.sequences

    def _output_cap(self, req: InferenceRequest) -> int:
        """Tokens ``req`` may generate per sequence: its output cap, else the
        gateway's ``default_output_tokens``."""
        cap = req.max_output_tokens
        return self.default_output_tokens if cap is None else cap

    def _sizing(self, tenant: TenantQuota, req: InferenceRequest) -> Sizing:
        return reservation_size(
            tenant, prompt_tokens=req.prompt_tokens, output_cap=req.max_output_tokens,
            sequences=req.sequences, default_output_tokens=self.default_output_tokens,
            output_param=req.output_field, prompt_param=req.prompt_param)

    async def _measure(self, req: InferenceRequest) -> None:
        """Tokenize the prompt once (off the event loop for a real tokenizer): its
        token count (tools, tool calls and media parts included; exact where the
        model's tokenizer is known and nothing was added) and its blocks."""
        salt = req.body.get("cache_salt") if req.model in self._salted else None
        assert req.prompt is not None
        m = await self.prompts.measure(req.model, req.prompt, salt, large=req.large)
        req.measured(m.tokens, m.blocks, exact=m.exact)

    # ------------------------------------------------------------------ placement

    def _need(self, request: web.Request, req: InferenceRequest,
              tenant: TenantQuota, arrived: float) -> Need:
        sched = SchedRequest(model=req.model, tenant=tenant.name,
                             prompt_tokens=req.prompt_tokens, priority=tenant.priority,
                             blocks=req.blocks, block_size=self.prompts.block_size(req.model),
                             session_id=session_key(tenant.name, request.headers.get("x-session-id")))
        return Need(sched, tenant.priority, self._kv_tokens(req), arrived=arrived,
                    splittable=req.sequences == 1 and req.endpoint in ("chat", "completions"),
                    output_tokens=self._output_cap(req))

    def _no_engine(self, req: InferenceRequest) -> Rejected:
        return Rejected(Outcome.NO_ENGINE,
                        f"No engine serving '{req.model}' is ready; retry shortly.",
                        retry_after_s=NO_ENGINE_RETRY_S)

    def _degrade(self, req: InferenceRequest, tenant: TenantQuota, rec: RequestRecord,
                 max_wait_s: float) -> None:
        """The degradation ladder for a sheddable request on a saturated model (one
        whose queue is not empty or where no engine has room now): climb one rung at a
        time (cap output, then fallback model) while still saturated; past the last
        rung, shed the request if its predicted queue wait (tickets of its band and
        more urgent ones / drain rate) exceeds what it may wait.

        Raises:
            Rejected: ``OVERLOADED`` (reason ``shed``) as described.
        """
        dcfg = self._degradation[req.model]
        if tenant.priority not in dcfg.sheddable:
            return
        rungs = ladder(dcfg, tenant.priority)
        if not rungs and not len(self.queues[req.model]):
            return  # nothing to climb, and an empty queue predicts no wait: not shed

        def saturated() -> bool:
            return bool(len(self.queues[req.model])) or not self.placer.candidates(
                req.model, tenant.priority, self._kv_tokens(req))

        for rung in rungs:
            if not saturated():
                return
            if rung.fallback_model is not None and rung.fallback_model not in self.queues:
                break  # a fallback nobody serves
            action = req.apply(rung)
            if action is not None:
                rec.degraded = (*rec.degraded, action)
        queue = self.queues[req.model]
        if len(queue) and queue.predicted_wait_s(tenant.priority) > max_wait_s:
            raise shed(req.model, tenant.priority, queue.retry_after_s())

    # ------------------------------------------------------------------ pipeline

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = self.clock.now()
        tenant = request[TENANT]
        rec = request[RECORD]
        rec.inference, rec.priority, rec.endpoint = True, tenant.priority, endpoint
        try:
            req = await self._parse(endpoint, await self._read_body(request), tenant)
            rec.stream = req.stream
            self._check_model(tenant, req)
            rec.model = req.model  # a configured one: the client's name never becomes a label
            self._check_sequences(tenant, req)
            if req.model in self._salted:  # before the cache key: lookup and store agree
                req.body["cache_salt"] = cache_salt(tenant.namespace, req.body.get("cache_salt"))
            await self._measure(req)
            self._apply_tenant_caps(tenant, req)
            timeout_s = _request_timeout(request)
            creq = self._cache_request(request, tenant, req)
            if creq is not None and self.cache.eligible(creq):  # type: ignore[union-attr]
                rec.cache = "miss"
                with self.spans("cache.lookup") as span:
                    hit = await self.cache.lookup(creq)  # type: ignore[union-attr]
                    span.set_attribute("sluice.cache.hit", hit.kind if hit else "miss")
                if hit is not None:
                    async with await self._reserve(tenant, 0, rec, concurrency=False):
                        return await self._answer_from_cache(request, req, hit, rec, started)
            size = self._sizing(tenant, req) if req.endpoint not in TOKEN_FREE else Sizing(0, 0)
            if req.max_output_tokens is None and tenant.tokens_per_min is not None:
                # the quota holds only if the engine stops where the reservation does
                req.set_output_cap(size.output // req.sequences)
            rec.reserved_output_tokens = size.output
            async with await self._reserve(tenant, size.total, rec) as reservation:
                try:
                    result = await self._admit_and_send(request, req, tenant, rec, timeout_s,
                                                        started)
                except Rejected as e:
                    if e.outcome.refunded:  # the service refused it: the client owes nothing
                        await reservation.refund()
                    raise
                finally:
                    await reservation.settle(rec.prompt_tokens + rec.completion_tokens)
            if creq is not None and result.answer is not None and not (
                    req.stream and STREAM_LOSSY.intersection(req.body)):
                self._store_later(creq, req, result.answer)
            return result.response
        except asyncio.CancelledError:
            rec.outcome = Outcome.CLIENT_DISCONNECTED
            raise
    async def _parse(self, endpoint: Endpoint, raw: bytes,
                     tenant: TenantQuota) -> InferenceRequest:
        """Parse and validate ``raw`` (a Responses body's ``previous_response_id``
        expanded first: :meth:`_expand_conversation`); in a worker thread when it is
        over ``gateway.offload_bytes`` (JSON parsing costs ~8 ns per byte: 50 ms for
        6 MB), which also marks the request ``large`` for the steps after it."""
        large = len(raw) > self.cfg.gateway.offload_bytes
        body = await asyncio.to_thread(parse_json, raw) if large else parse_json(raw)
        if endpoint == "responses":
            body = await self._expand_conversation(tenant, body)
        req = (await asyncio.to_thread(parse_request, endpoint, body) if large
               else parse_request(endpoint, body))
        req.large = large
        return req

    async def _expand_conversation(self, tenant: TenantQuota,
                                   body: dict) -> dict:
        """A Responses body with ``previous_response_id`` replaced by the stored
        conversation it names, prepended to its ``input`` (the engine is sent the
        whole conversation; :mod:`cache.conversations`).

        Raises:
            Rejected: 404 ``not_found`` when the tenant has no such stored response;
                503 when the store cannot be read.
        """
        previous = body.get("previous_response_id")
        if not isinstance(previous, str) or not previous or len(previous) > 256:
            return body  # absent, or the body's validation names it
        try:
            history = await self.responses.history(tenant.namespace, previous)
        except STORE_ERRORS as e:
            raise Rejected(Outcome.OVERLOADED, "The conversation store is unavailable; retry "
                           "shortly.", retry_after_s=NO_ENGINE_RETRY_S,
                           reason="conversation_store") from e
        if history is None:
            raise Rejected(Outcome.NOT_FOUND, f"Previous response with id '{previous}' not "
                           "found.", param="previous_response_id")
        out = {k: v for k, v in body.items() if k != "previous_response_id"}
        out["input"] = [*history, *input_items(body.get("input"))]
        return out

    async def _remember(self, tenant: TenantQuota, req: InferenceRequest,
                        answer: dict) -> None:
        """Keep a finished Responses answer for follow-ups (unless ``store: false``);
        a store failure is logged, the answer still goes out."""
        if req.body.get("store") is False:
            return
        try:
            await self.responses.put(tenant.namespace, input_items(req.body.get("input")),
                                     answer)
        except STORE_ERRORS as e:
            log.warning("response %s not stored: %r", answer.get("id"), e)

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, which must arrive within ``timeouts.request_body_s``.

        Raises:
            Rejected: 408 ``request_timeout`` (a client that stalls mid-body would
                otherwise hold a connection, and shutdown, indefinitely).
        """
        if request.content.is_eof():  # all of it arrived with the head: nothing to wait for
            return await request.read()
        limit = self.cfg.gateway.timeouts.request_body_s
        try:
            async with asyncio.timeout(limit):
                return await request.read()
        except TimeoutError:
            raise Rejected(Outcome.REQUEST_TIMEOUT,
                           f"The request body did not arrive within {limit:g} s.") from None

    async def _reserve(self, tenant: TenantQuota, tokens: int, rec: RequestRecord, *,
                       concurrency: bool = True) -> Reservation:
        with self.spans("ratelimit.reserve") as span:
            span.set_attribute("sluice.reserved_tokens", tokens)
            return await self.limiter.reserve(tenant, tokens, request_id=rec.request_id,
                                              concurrency=concurrency)

    def _cache_request(self, request: web.Request, tenant: TenantQuota,
                       req: InferenceRequest) -> CacheRequest | None:
        """The cache's view of ``req``, or None when the cache is off."""
        if self.cache is None or not self.cache.cfg.enabled \
                or req.endpoint not in CACHED_ENDPOINTS:
            return None
        no_cache, no_store = _cache_control(request)
        return CacheRequest(namespace=tenant.namespace, tenant=tenant.cache,
                            endpoint=req.endpoint, model=req.model, body=dict(req.body),
                            no_cache=no_cache, no_store=no_store, large=req.large)

    def _store_later(self, creq: CacheRequest, req: InferenceRequest, answer: dict) -> None:
        """Store a finished answer off the response path (the semantic cache embeds
        the question, ~20 ms on CPU), under the very request it was looked up with
        (``creq``: the body before the gateway's own edits, so lookup and store
        compute one key). Not stored: a fallback model's answer (not the requested
        model's), and an answer cut (``length``) at an output cap the gateway wrote
        after the lookup (the tokens/min cap, a degradation rung): the request as
        looked up did not ask for that cut. An answer that stopped by itself is the
        same under any larger cap, so it is stored."""
        assert self.cache is not None
        if creq.no_store or not request_cacheable(creq.body, creq.tenant, req.endpoint):
            return  # what ResponseCache.store would decide, without a task per request
        if req.model != creq.model:
            return
        if req.max_output_tokens != output_cap(req.endpoint, creq.body)[1] and any(
                isinstance(c, dict) and c.get("finish_reason") == "length"
                for c in answer.get("choices") or ()):
            return
        task = asyncio.create_task(self.cache.store(creq, answer))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer_from_cache(self, request: web.Request, req: InferenceRequest,
                                 hit: CacheHit, rec: RequestRecord,
                                 started: float) -> web.StreamResponse:
        rec.cache, rec.outcome = f"hit-{hit.kind}", Outcome.CACHE_HIT
        usage = hit.response.get("usage") or {}
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.completion_tokens = usage.get("completion_tokens", 0)
        rec.ttft_s = self.clock.now() - started
        headers = {"x-request-id": rec.request_id, "x-sluice-cache": rec.cache}
        if not req.stream:
            return web.json_response(as_json(hit.response, req.endpoint, req.model),
                                     headers=headers)
        out = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await out.prepare(request)
        await out.write(b"".join(as_sse(hit.response, req.endpoint, req.model,
                                        include_usage=req.client_usage)))
        await out.write_eof()
        return out

    async def _admit_and_send(self, request: web.Request, req: InferenceRequest,
                              tenant: TenantQuota, rec: RequestRecord,
                              timeout_s: float | None, arrived: float) -> ProxyResult:
        ready = [e for e in self.pool.for_model(req.model) if e.routable]
        if not ready:
            raise self._no_engine(req)
        capacity = [c for e in ready if (c := e.kv_capacity_tokens)]
        kv = self._kv_tokens(req)
        if capacity and len(capacity) == len(ready) and kv > max(capacity):
            raise Rejected(Outcome.CONTEXT_LENGTH_EXCEEDED,
                           f"This request needs about {kv} tokens of KV cache (prompt + max "
                           f"output × sequences); the largest engine holds {max(capacity)}.",
                           param=req.prompt_param)
        max_wait = min(tenant.max_queue_wait_s or self.cfg.gateway.queue.default_max_wait_s,
                       timeout_s or math.inf)
        # at best effort the deadline bounds the answer: the wait leaves room for the run
        bound = self.placer.best_effort_wait_s(req.model, tenant.priority, max_wait)
        if bound is not None:
            timeout_s = max_wait = bound
        model = req.model
        self.placer.band_demand(model).arrived(tenant.priority)
        self._degrade(req, tenant, rec, max_wait)
        if req.model != model:  # a fallback model: its own tokenizer and blocks
            await self._measure(req)
        need = self._need(request, req, tenant, arrived)
        queue = self.queues[req.model]
        ticket = queue.ticket(tenant, need.tokens, request_id=rec.request_id,
                              timeout_s=timeout_s)
        with self.spans("queue.wait") as span:
            span.set_attribute("sluice.priority", tenant.priority)
            span.set_attribute("sluice.queue_depth", len(queue))
            waited_from = self.clock.now()
            try:
                first = await queue.admit(ticket, lambda _t: self.placer.place(need),
                                          Placement.release)
            finally:
                rec.queue_s = self.clock.now() - waited_from
        prefilled: Engine | None = None
        if first.prefill is not None:
            split_from = self.clock.now()
            try:
                req, prefilled = await self.prefill_leg.run(
                    self.placer.prefill_attempts(first, need, self.cfg.gateway.retry_attempts),
                    req, request, rec.request_id, first.uncached, first.start_by,
                    first.sheddable)
            except LegShed as e:
                first.release()
                raise self._prefill_shed(tenant, queue) from e
            except asyncio.CancelledError:
                rec.prompt_tokens = req.prompt_tokens  # the prefill engine computed it
                first.release()
                raise
            except BaseException:
                first.release()
                raise
            rec.prefill_s = self.clock.now() - split_from
        failed: UpstreamFailed | None = None
        for placement in self.placer.attempts(first, need, self.cfg.gateway.retry_attempts):
            async with placement:
                try:
                    result = await self._send(request, req, rec, placement, prefilled,
                                              tenant)
                except UpstreamFailed as e:
                    if e.outcome in (Outcome.UPSTREAM_TIMEOUT, Outcome.NO_ENGINE):
                        placement.engine.breaker.record(False)
                    failed = e
                    if not e.retryable:
                        break
                    continue
                except LegShed as e:  # its local prefill, held past its latest start
                    raise self._prefill_shed(tenant, queue) from e
                except ClientGone as gone:  # charged what the engine generated
                    rec.prompt_tokens, rec.completion_tokens = (gone.prompt_tokens,
                                                                gone.completion_tokens)
                    raise
                except asyncio.CancelledError:
                    rec.prompt_tokens = req.prompt_tokens  # the engine did the prefill
                    raise
                placement.engine.breaker.record(True)
                return result
        assert failed is not None
        raise self._final_error(req, failed)

    def _prefill_shed(self, tenant: TenantQuota, queue: AdmissionQueue[Placement]) -> Rejected:
        """The error of a request whose prefill was held at the gateway past its
        latest start (:class:`gateway.prefill_queue.LegShed`)."""
        target = self.slo.target(tenant.priority).ttft_s
        return Rejected(Outcome.OVERLOADED,
                        f"this {tenant.priority} request's prefill could not start "
                        f"within its {target:g} s TTFT target any more; shed",
                        retry_after_s=queue.retry_after_s(), reason="predicted_miss")

    async def _send(self, request: web.Request, req: InferenceRequest, rec: RequestRecord,
                    placement: Placement, prefilled: Engine | None,
                    tenant: TenantQuota) -> ProxyResult:
        """One upstream attempt on ``placement``'s engine (the decode leg when
        ``prefilled`` names the engine that ran the prefill leg); fills ``rec`` on
        success, its TTFT counting both legs, and feeds the engine's latency ledger
        (first token, usage, end; whole requests only). The band goes to the engine as
        vLLM's ``priority`` (0 most urgent) only where it runs the priority scheduler.

        Raises:
            UpstreamFailed: as :meth:`EngineClient.send`.
        """
        rec.engine, rec.scores = placement.engine.id, placement.scores
        with self.spans("schedule") as span:
            span.set_attribute("sluice.engine", placement.engine.id)
            for name, score in placement.scores.items():
                span.set_attribute(f"sluice.score.{name}", score)
        headers = {"x-request-id": rec.request_id, "x-sluice-engine": placement.engine.id,
                   "x-sluice-queue-ms": f"{(rec.queue_s or 0.0) * 1000:.1f}",
                   "x-sluice-cache": rec.cache}
        if rec.degraded:
            headers[DEGRADED_HEADER] = ", ".join(rec.degraded)
        if prefilled is not None:
            headers[PREFILL_ENGINE_HEADER] = prefilled.id
        if placement.prefix_tokens:
            headers[PREFIX_TOKENS_HEADER] = ", ".join(
                f"{k}={v}" for k, v in placement.prefix_tokens.items())
        engine, flight = placement.engine, placement.flight
        ledger = engine.latency if flight is not None else None
        if flight is not None:
            headers["x-sluice-ttft-predicted-ms"] = f"{flight.predicted_ttft_s * 1000:.1f}"
        # a whole request of a split model: its prompt is prefill queued on the engine
        tracked = req.model in self.split_models and prefilled is None
        held = None
        if tracked:
            with self.spans("queue.prefill"):
                held = await self.placer.hold_local_prefill(placement)
        with self.spans("upstream", kind=SpanKind.CLIENT) as span, \
                self.placer.prefill_tracking(placement, tracked, held) as first_token:
            span.set_attribute("sluice.engine", engine.id)
            upstream = {"x-request-id": rec.request_id}
            if self.spans.enabled:
                inject_traceparent(upstream)
            callbacks = [f for f in (first_token, None if ledger is None else
                                     functools.partial(ledger.first_token, flight))
                         if f is not None]
            result = await self.client.send(
                engine, req, request, headers, upstream,
                functools.partial(_call_all, callbacks) if callbacks else None,
                priority=PRIORITIES.index(tenant.priority) if engine.priority_scheduling else None,
                on_answer=functools.partial(self._remember, tenant, req)
                if req.endpoint == "responses" else None)
        if ledger is not None:
            rec.predicted_ttft_s = flight.predicted_ttft_s
            ok = result.outcome is Outcome.OK
            ledger.finished(flight, completion_tokens=result.completion_tokens,
                            prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
                            ok=ok and prefilled is None and req.generates,
                            streamed=req.stream)
            if ok and req.generates:
                uncached = flight.uncached_tokens if result.cached_tokens is None \
                    else max(0, result.prompt_tokens - result.cached_tokens)
                mix = self.mix.get(engine.model)  # None: the model left with a reload
                if mix is not None:
                    mix.observe(result.prompt_tokens, uncached, result.completion_tokens)
        rec.outcome = result.outcome
        rec.ttft_s = None if result.ttft_s is None else (rec.prefill_s or 0.0) + result.ttft_s
        rec.prompt_tokens, rec.completion_tokens = result.prompt_tokens, result.completion_tokens
        rec.finish_reasons = result.finish_reasons
        return result

    def _final_error(self, req: InferenceRequest, failed: UpstreamFailed) -> Rejected:
        if failed.final is not None:
            return failed.final
        if failed.outcome is Outcome.UPSTREAM_TIMEOUT:
            return Rejected(Outcome.UPSTREAM_TIMEOUT, "The engine did not answer in time.")
        if failed.outcome is Outcome.NO_ENGINE:
            return self._no_engine(req)
        return Rejected(Outcome.UPSTREAM_ERROR, "The engine failed to answer; retry shortly.")
