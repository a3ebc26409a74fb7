"""The per-request pipeline (DESIGN.md, "Request flow"): parse → tenant checks →
cache lookup → rate limit → admission (queue, degradation, shedding) → schedule →
proxy (retrying on another engine only before the first byte) → finish.

Everything a request acquires (rate-limit reservation, concurrency slot, engine lease
and its promised KV blocks) is released in ``finally``, exactly once, whether it ends
in success, error, timeout or client disconnect.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.trace import SpanKind

from cache.policy import request_cacheable
from cache.replay import as_json, as_sse
from cache.service import CacheHit, CacheRequest, ResponseCache
from config.schema import Config, DegradationConfig, TenantQuota
from engines.pool import Engine, EnginePool
from engines.prompt import PromptBlocks, PromptInput, cache_salt
from engines.scheduler import SchedRequest, Scheduler
from gateway.keys import RECORD, TENANT
from gateway.openai_api import Endpoint, InferenceRequest, parse_json, parse_request
from gateway.proxy import SSE_HEADERS, EngineClient, ProxyResult, UpstreamFailed
from gateway.record import RequestRecord
from gateway.tracing import Spans, inject_traceparent
from limits.admission import AdmissionQueue
from limits.degrade import DEGRADED_HEADER, degrade
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter, Reservation
from limits.saturation import SaturationDetector, kv_blocks

#: Request fields whose output a streamed answer, reassembled, would not keep
#: (``StreamSummary.to_response`` rebuilds text only): such answers are not cached.
STREAM_LOSSY = frozenset({"logprobs", "top_logprobs", "tools", "functions"})

#: Retry-After, s, when no engine serving the model is ready (engines restart with
#: backoff starting at 1 s; a few seconds is the honest order of magnitude).
NO_ENGINE_RETRY_S = 5


#: Response header: prompt tokens the prefix index predicted cached on the chosen
#: engine, per index (``events=N, approximate=M``); the replay benchmark compares it
#: with the engine's ``usage.prompt_tokens_details.cached_tokens``.
PREFIX_TOKENS_HEADER = "x-sluice-prefix-tokens"


@dataclass
class Placement:
    """An engine lease taken for one request: ``blocks`` promised KV blocks;
    ``prefix_tokens`` as :attr:`engines.scheduler.Decision.prefix_tokens`."""

    engine: Engine
    blocks: int
    scores: dict[str, float]
    prefix_tokens: dict[str, int] = field(default_factory=dict)


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


def _cache_control(request: web.Request) -> tuple[bool, bool]:
    """(no_cache, no_store) from ``Cache-Control``."""
    tokens = {t.strip().lower() for t in request.headers.get("Cache-Control", "").split(",")}
    return "no-cache" in tokens, "no-store" in tokens


class Director:
    """Runs requests through the pipeline; one per app.

    Args:
        queues: one admission queue per served model.
        cache: the response cache, or None when disabled.
        default_output_tokens: output tokens reserved for a request that sets no cap.
    """

    def __init__(self, cfg: Config, pool: EnginePool, scheduler: Scheduler,
                 client: EngineClient, limiter: RateLimiter,
                 queues: dict[str, AdmissionQueue[Placement]], detector: SaturationDetector,
                 cache: ResponseCache | None, spans: Spans | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.scheduler = scheduler
        self.client = client
        self.limiter = limiter
        self.queues = queues
        self.detector = detector
        self.cache = cache
        #: each served model's degradation ladder (model_settings builds a pydantic
        #: object per call, too costly per request)
        self._degradation: dict[str, DegradationConfig] = {
            m: cfg.engines.model_settings(m).degradation for m in queues}
        self.spans = spans or Spans(None)
        self.prompts = PromptBlocks(cfg.engines, pool)
        #: models whose every engine accepts vLLM's ``cache_salt``
        self._salted = {m for m in cfg.engines.model_names()
                        if cfg.engines.scheduler.prefix.cache_salt
                        and all(s.accepts_cache_salt for s in cfg.engines.engines if s.model == m)}
        self.default_output_tokens = cfg.gateway.default_output_tokens
        self._background: set[asyncio.Task[object]] = set()

    # ------------------------------------------------------------------ checks

    def _check_model(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        allowed = tenant.allowed_models
        if req.model not in self.queues or (allowed is not None and req.model not in allowed):
            raise Rejected(
                Outcome.MODEL_NOT_FOUND,
                f"The model '{req.model}' does not exist or you do not have access to it.",
                param="model",
            )

    def _apply_tenant_caps(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        if tenant.max_prompt_tokens is not None and req.prompt_tokens > tenant.max_prompt_tokens:
            raise Rejected(
                Outcome.CONTEXT_LENGTH_EXCEEDED,
                f"This request's prompt is about {req.prompt_tokens} tokens; your limit is "
                f"{tenant.max_prompt_tokens} tokens.",
                param="messages" if req.endpoint == "chat" else "prompt",
            )
        cap = tenant.max_output_tokens
        if cap is None:
            return
        if req.max_output_tokens is None:
            req.set_output_cap(cap)
        elif req.max_output_tokens > cap:
            raise Rejected(
                Outcome.INVALID_REQUEST,
                f"'{req.output_field}' is {req.max_output_tokens}; your limit is {cap} tokens.",
                param=req.output_field,
            )

    def _tokens(self, req: InferenceRequest) -> int:
        """Tokens reserved for ``req``: prompt estimate + output cap (or default)."""
        return req.prompt_tokens + (req.max_output_tokens or self.default_output_tokens)

    # ------------------------------------------------------------------ placement

    def _candidates(self, req: InferenceRequest, tenant: TenantQuota,
                    exclude: frozenset[str] = frozenset()) -> list[Engine]:
        now, tokens = time.monotonic(), self._tokens(req)
        return [e for e in self.pool.for_model(req.model)
                if e.routable and e.id not in exclude
                and self.detector.admits(e, tenant.priority, tokens, now)]

    async def _sched_request(self, request: web.Request, req: InferenceRequest,
                             tenant: TenantQuota) -> SchedRequest:
        """The scheduler's view of ``req``, prompt blocks computed once per request."""
        salt = req.body.get("cache_salt") if req.model in self._salted else None
        blocks = await self.prompts.blocks(req.model, PromptInput.from_body(req.body), salt)
        return SchedRequest(model=req.model, tenant=tenant.name,
                            prompt_tokens=req.prompt_tokens, priority=tenant.priority,
                            blocks=blocks, block_size=self.prompts.block_size(req.model),
                            session_id=request.headers.get("x-session-id") or None)

    def _place(self, req: InferenceRequest, tenant: TenantQuota, sreq: SchedRequest,
               exclude: frozenset[str] = frozenset()) -> Placement | None:
        """Choose an engine with room and take its lease, or None (synchronous: the
        admission queue calls it)."""
        candidates = self._candidates(req, tenant, exclude)
        if not candidates:
            return None
        now = time.monotonic()
        decision = self.scheduler.pick(sreq, candidates, now)
        if decision is None:
            return None
        blocks = kv_blocks(self._tokens(req), decision.engine.block_size)
        self.pool.acquire(decision.engine, blocks)
        self.scheduler.record(sreq, decision.engine, now)
        return Placement(decision.engine, blocks, decision.scores, decision.prefix_tokens)

    def _release(self, placement: Placement) -> None:
        self.pool.release(placement.engine, placement.blocks)

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
        more urgent ones / drain rate)
        exceeds what it may wait.

        Raises:
            Rejected: ``OVERLOADED`` (reason ``shed``) as described.
        """
        dcfg = self._degradation[req.model]
        if tenant.priority not in dcfg.sheddable:
            return
        rungs = (dcfg.max_tokens_cap is not None) + (dcfg.fallback_model is not None)
        if rungs == 0 and not len(self.queues[req.model]):
            return  # nothing to climb, and an empty queue predicts no wait: not shed
        original = dict(req.body)

        def saturated() -> bool:
            return bool(len(self.queues[req.model])) or not self._candidates(req, tenant)

        for level in range(1, rungs + 1):
            if not saturated():
                return
            d = degrade(original, priority=tenant.priority, config=dcfg, level=level,
                        retry_after_s=self.queues[req.model].retry_after_s())
            if d.body.get("model") not in self.queues:  # fallback nobody serves
                break
            rec.degraded = d.actions
            req.apply_body(d.body)
        queue = self.queues[req.model]
        if len(queue) and queue.predicted_wait_s(tenant.priority) > max_wait_s:
            degrade(original, priority=tenant.priority, config=dcfg, level=rungs + 1,
                    retry_after_s=queue.retry_after_s())

    # ------------------------------------------------------------------ pipeline

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        tenant = request[TENANT]
        rec = request[RECORD]
        rec.inference, rec.priority = True, tenant.priority
        try:
            req = parse_request(endpoint, parse_json(await self._read_body(request)))
            rec.model, rec.stream = req.model, req.stream
            self._check_model(tenant, req)
            self._apply_tenant_caps(tenant, req)
            if req.model in self._salted:  # before the cache key: lookup and store agree
                req.body["cache_salt"] = cache_salt(tenant.namespace, req.body.get("cache_salt"))
            timeout_s = _request_timeout(request)
            creq = self._cache_request(request, tenant, req)
            if creq is not None and self.cache.eligible(creq):  # type: ignore[union-attr]
                rec.cache = "miss"
                with self.spans("cache.lookup") as span:
                    hit = await self.cache.lookup(creq)  # type: ignore[union-attr]
                    span.set_attribute("sluice.cache.hit", hit.kind if hit else "miss")
                if hit is not None:
                    async with await self._reserve(tenant, 0, rec, concurrency=False):
                        return await self._answer_from_cache(request, req, hit, rec)
            async with await self._reserve(tenant, self._tokens(req), rec) as reservation:
                try:
                    result = await self._admit_and_send(request, req, tenant, rec, timeout_s)
                finally:
                    await reservation.settle(rec.prompt_tokens + rec.completion_tokens)
            if creq is not None and result.answer is not None and not (
                    req.stream and STREAM_LOSSY.intersection(req.body)):
                self._store_later(creq, req, result.answer)
            return result.response
        except asyncio.CancelledError:
            rec.outcome = Outcome.CLIENT_DISCONNECTED
            raise

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, which must arrive within ``timeouts.request_body_s``.

        Raises:
            Rejected: 408 ``request_timeout`` (a client that stalls mid-body would
                otherwise hold a connection, and shutdown, indefinitely).
        """
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
        if self.cache is None or not self.cache.cfg.enabled:
            return None
        no_cache, no_store = _cache_control(request)
        return CacheRequest(namespace=tenant.namespace, tenant=tenant.cache,
                            endpoint=req.endpoint, model=req.model, body=dict(req.body),
                            no_cache=no_cache, no_store=no_store)

    def _store_later(self, creq: CacheRequest, req: InferenceRequest, answer: dict) -> None:
        """Store a finished answer off the response path (the semantic cache embeds
        the question, ~20 ms on CPU)."""
        assert self.cache is not None
        if creq.no_store or not request_cacheable(req.body, creq.tenant):
            return  # what ResponseCache.store would decide, without a task per request
        final = CacheRequest(namespace=creq.namespace, tenant=creq.tenant,
                             endpoint=creq.endpoint, model=req.model, body=req.body,
                             no_store=creq.no_store)
        task = asyncio.create_task(self.cache.store(final, answer))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer_from_cache(self, request: web.Request, req: InferenceRequest,
                                 hit: CacheHit, rec: RequestRecord) -> web.StreamResponse:
        rec.cache, rec.outcome = f"hit-{hit.kind}", Outcome.CACHE_HIT
        usage = hit.response.get("usage") or {}
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.completion_tokens = usage.get("completion_tokens", 0)
        rec.ttft_s = time.perf_counter() - rec.started
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
                              timeout_s: float | None) -> ProxyResult:
        ready = [e for e in self.pool.for_model(req.model) if e.routable]
        if not ready:
            raise self._no_engine(req)
        capacity = [e.num_blocks * e.block_size for e in ready if e.num_blocks and e.block_size]
        if capacity and len(capacity) == len(ready) and self._tokens(req) > max(capacity):
            raise Rejected(Outcome.CONTEXT_LENGTH_EXCEEDED,
                           f"This request needs about {self._tokens(req)} tokens of KV cache "
                           f"(prompt + max output); the largest engine holds {max(capacity)}.",
                           param="messages" if req.endpoint == "chat" else "prompt")
        max_wait = min(tenant.max_queue_wait_s or self.cfg.gateway.queue.default_max_wait_s,
                       timeout_s or math.inf)
        self._degrade(req, tenant, rec, max_wait)
        sreq = await self._sched_request(request, req, tenant)
        queue = self.queues[req.model]
        ticket = queue.ticket(tenant, self._tokens(req), request_id=rec.request_id,
                              timeout_s=timeout_s)
        with self.spans("queue.wait") as span:
            span.set_attribute("sluice.priority", tenant.priority)
            span.set_attribute("sluice.queue_depth", len(queue))
            waited_from = time.perf_counter()
            try:
                placement = await queue.admit(ticket, lambda _t: self._place(req, tenant, sreq),
                                              self._release)
            finally:
                rec.queue_s = time.perf_counter() - waited_from
        tried: set[str] = set()
        while True:
            rec.engine, rec.scores = placement.engine.id, placement.scores
            with self.spans("schedule") as span:
                span.set_attribute("sluice.engine", placement.engine.id)
                for name, score in placement.scores.items():
                    span.set_attribute(f"sluice.score.{name}", score)
            headers = {"x-request-id": rec.request_id, "x-sluice-engine": placement.engine.id,
                       "x-sluice-queue-ms": f"{rec.queue_s * 1000:.1f}", "x-sluice-cache": rec.cache}
            if rec.degraded:
                headers[DEGRADED_HEADER] = ", ".join(rec.degraded)
            if placement.prefix_tokens:
                headers[PREFIX_TOKENS_HEADER] = ", ".join(
                    f"{k}={v}" for k, v in placement.prefix_tokens.items())
            try:
                with self.spans("upstream", kind=SpanKind.CLIENT) as span:
                    span.set_attribute("sluice.engine", placement.engine.id)
                    upstream = {"x-request-id": rec.request_id}
                    if self.spans.enabled:
                        inject_traceparent(upstream)
                    result = await self.client.send(placement.engine, req, request, headers,
                                                    upstream)
                placement.engine.upstream_failures = 0
                rec.outcome, rec.ttft_s = result.outcome, result.ttft_s
                rec.prompt_tokens, rec.completion_tokens = result.prompt_tokens, result.completion_tokens
                rec.finish_reasons = result.finish_reasons
                return result
            except UpstreamFailed as failed:
                if failed.outcome in (Outcome.UPSTREAM_TIMEOUT, Outcome.NO_ENGINE):
                    placement.engine.upstream_failures += 1  # the supervisor's probes read it
                tried.add(placement.engine.id)
                retry = failed.retryable and len(tried) < self.cfg.gateway.retry_attempts
                nxt = self._place(req, tenant, sreq, frozenset(tried)) if retry else None
                if nxt is None:
                    raise self._final_error(req, failed) from None
            except asyncio.CancelledError:
                rec.prompt_tokens = req.prompt_tokens  # the engine did the prefill
                raise
            finally:
                self._release(placement)
            placement = nxt

    def _final_error(self, req: InferenceRequest, failed: UpstreamFailed) -> Rejected:
        if failed.outcome is Outcome.UPSTREAM_TIMEOUT:
            return Rejected(Outcome.UPSTREAM_TIMEOUT, "The engine did not answer in time.")
        if failed.outcome is Outcome.NO_ENGINE:
            return self._no_engine(req)
        return Rejected(Outcome.UPSTREAM_ERROR, "The engine failed to answer; retry shortly.")
