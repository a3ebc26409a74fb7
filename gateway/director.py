"""The per-request pipeline: orchestrates the steps of docs/architecture.md, "One
request", each of which is owned by another module.

Everything a request acquires (rate-limit reservation, concurrency slot, engine lease
and its promised KV blocks) is held by an ``async with`` and released exactly once,
whether it ends in success, error, timeout or client disconnect. Intake checks live
in :mod:`gateway.intake`, admission in :mod:`gateway.admission`, engine choice and
leases in :mod:`gateway.placement`, the retry loop in :mod:`gateway.attempts`, the
cache's lookup, store and replay in :mod:`cache.service`, the Responses API's stored
conversations in :mod:`gateway.responses`; this module orchestrates.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry.trace import SpanKind

from cache.conversations import ResponseStore
from cache.service import ResponseCache, replay
from cache.stores import MemoryByteStore
from config.schema import PRIORITIES, Config, EnginesConfig, TenantQuota
from engines.pool import Engine, EnginePool
from engines.prompt import PromptBlocks, cache_salt
from engines.scheduler import Scheduler
from engines.sessions import session_key
from gateway import intake
from gateway.admission import Admission, gone
from gateway.attempts import final_error, first_success
from gateway.capacity import CapacityReport
from gateway.disagg import Disaggregator, PrefillLeg, split_models
from gateway.keys import RECORD, TENANT
from gateway.openai_api import TOKEN_FREE, Endpoint, InferenceRequest, output_cap
from gateway.placement import Placement, Placer
from gateway.prefill_queue import LegShed
from gateway.proxy import SSE_HEADERS, ClientGone, EngineClient, ProxyResult
from gateway.record import RequestRecord
from gateway.responses import expander, remember
from gateway.tracing import Spans, inject_traceparent
from limits import capacity
from limits.admission import AdmissionQueue
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter, Reservation, Sizing
from limits.saturation import SaturationDetector
from limits.slo_gate import SloGate


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
        gate: the SLO gate (built from ``cfg`` when None).
        responses: the Responses API's stored conversations (``previous_response_id``);
            None: in this process's memory.
    """

    def __init__(self, *, cfg: Config, pool: EnginePool, scheduler: Scheduler,
                 client: EngineClient, limiter: RateLimiter,
                 queues: dict[str, AdmissionQueue[Placement]], detector: SaturationDetector,
                 cache: ResponseCache | None, clock: Clock, spans: Spans | None = None,
                 prompts: PromptBlocks | None = None, gate: SloGate | None = None,
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
        self.gate = gate or SloGate(slo=self.slo, adaptive=self.adaptive, clock=clock,
                                    retry_after=lambda m: self.queues[m].retry_after_s())
        #: prefill–decode disaggregation, for models with prefill engines
        self.split_models = split_models(cfg.engines)
        disagg = Disaggregator(cfg.engines.disaggregation, clock, tpot_target_s=min(
            self.slo.target(p).tpot_s for p in PRIORITIES))
        self.placer = Placer(pool=pool, scheduler=scheduler, detector=detector, clock=clock,
                             disagg=disagg, split_models=self.split_models, gate=self.gate)
        #: per model, the mix of finished requests (the capacity report)
        self.mix = {m: capacity.MixTracker() for m in queues}
        self.capacity = CapacityReport(pool=pool, gate=self.gate, mix=self.mix,
                                       slo=self.slo, adaptive=self.adaptive)
        self.spans = spans or Spans(None)
        self.prefill_leg = PrefillLeg(client, disagg, self.spans)
        self.prompts = prompts or PromptBlocks(cfg.engines, pool)
        self.admission = Admission(
            engines=cfg.engines, queue=cfg.gateway.queue, pool=pool, placer=self.placer,
            queues=queues, prompts=self.prompts, clock=clock, spans=self.spans,
            default_output_tokens=cfg.gateway.default_output_tokens)
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
            self.queues.pop(model).close(functools.partial(gone, model))
            del self.mix[model]
            self.gate.drop_model(model)
        served = {m: self.queues.get(m) or AdmissionQueue(
            model=m, config=self.cfg.gateway.queue, clock=self.clock) for m in models}
        self.queues.clear()  # shared with the metrics and the stats feed: same dict
        self.queues.update(served)
        for model in models:
            self.mix.setdefault(model, capacity.MixTracker())
        self.admission.set_engines(engines)
        self.split_models = self.placer.split_models = split_models(engines)
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

    # ------------------------------------------------------------------ pipeline

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = self.clock.now()
        tenant = request[TENANT]
        rec = request[RECORD]
        rec.inference, rec.priority, rec.endpoint = True, tenant.priority, endpoint
        gw = self.cfg.gateway
        try:
            req = await intake.parse(
                endpoint, await intake.read_body(request, gw.timeouts.request_body_s),
                gw.offload_bytes, expander(self.responses, tenant, endpoint))
            rec.stream = req.stream
            intake.check_model(tenant, req, self.queues)
            rec.model = req.model  # a configured one: the client's name never becomes a label
            intake.check_sequences(tenant, req, gw.max_sequences)
            if req.model in self.admission.salted:  # before the cache key: lookup and store agree
                req.body["cache_salt"] = cache_salt(tenant.namespace, req.body.get("cache_salt"))
            await self.admission.measure(req)
            intake.apply_tenant_caps(tenant, req)
            timeout_s = intake.request_timeout(request)
            creq = None if self.cache is None else self.cache.request(
                namespace=tenant.namespace, tenant=tenant.cache, endpoint=req.endpoint,
                model=req.model, body=req.body, large=req.large,
                cache_control_header=request.headers.get("Cache-Control", ""))
            if creq is not None and self.cache.eligible(creq):  # type: ignore[union-attr]
                rec.cache = "miss"
                with self.spans("cache.lookup") as span:
                    hit = await self.cache.lookup(creq)  # type: ignore[union-attr]
                    span.set_attribute("sluice.cache.hit", hit.kind if hit else "miss")
                if hit is not None:
                    async with await self._reserve(tenant, 0, rec, concurrency=False):
                        rec.cache_hit(hit.kind, hit.response.get("usage") or {},
                                      self.clock.now() - started)
                        return await replay(
                            request, hit, req.endpoint, req.model, stream=req.stream,
                            include_usage=req.client_usage, sse_headers=SSE_HEADERS,
                            headers={"x-request-id": rec.request_id, "x-sluice-cache": rec.cache},
                            on_answer=self._remember(tenant, req))
            size = intake.sizing(tenant, req, gw.default_output_tokens) \
                if req.endpoint not in TOKEN_FREE else Sizing(0, 0)
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
            if creq is not None and result.answer is not None:
                self.cache.store_later(  # type: ignore[union-attr]
                    creq, result.answer, model=req.model, streamed=req.stream,
                    cap_written=req.max_output_tokens != output_cap(req.endpoint, creq.body)[1])
            return result.response
        except asyncio.CancelledError:
            rec.outcome = Outcome.CLIENT_DISCONNECTED
            raise

    def _remember(self, tenant: TenantQuota, req: InferenceRequest,
                  ) -> Callable[[dict[str, Any]], Awaitable[None]] | None:
        """What keeps a finished Responses answer for ``previous_response_id``
        (:func:`gateway.responses.remember`); None for the other endpoints."""
        if req.endpoint != "responses":
            return None
        return functools.partial(remember, self.responses, tenant, req)

    async def _reserve(self, tenant: TenantQuota, tokens: int, rec: RequestRecord, *,
                       concurrency: bool = True) -> Reservation:
        with self.spans("ratelimit.reserve") as span:
            span.set_attribute("sluice.reserved_tokens", tokens)
            return await self.limiter.reserve(tenant, tokens, request_id=rec.request_id,
                                              concurrency=concurrency)

    async def _admit_and_send(self, request: web.Request, req: InferenceRequest,
                              tenant: TenantQuota, rec: RequestRecord,
                              timeout_s: float | None, arrived: float) -> ProxyResult:
        """Admit ``req`` (:meth:`gateway.admission.Admission.admit`), run a split
        request's prefill leg, then the attempts (:func:`gateway.attempts.first_success`
        over :meth:`gateway.placement.Placer.attempts`).

        Raises:
            Rejected: admission's refusals, a prefill shed, or the last attempt's error.
        """
        first = await self.admission.admit(
            req, tenant, rec, arrived=arrived, timeout_s=timeout_s,
            session_id=session_key(tenant.name, request.headers.get("x-session-id")))
        assert first.need is not None
        prefilled: Engine | None = None
        if first.prefill is not None:
            req, prefilled = await self._prefill(request, req, tenant, rec, first)
        try:
            result, failed = await first_success(
                self.placer.attempts(first, first.need, self.cfg.gateway.retry_attempts),
                lambda placement: self._send(request, req, rec, placement, prefilled, tenant))
        except LegShed as e:  # its local prefill, held past its latest start
            raise self.admission.prefill_shed(tenant, req.model) from e
        except ClientGone as left:  # charged what the engine generated
            rec.prompt_tokens, rec.completion_tokens = left.prompt_tokens, left.completion_tokens
            raise
        except asyncio.CancelledError:
            rec.prompt_tokens = req.prompt_tokens  # the engine did the prefill
            raise
        if result is None:
            assert failed is not None
            raise final_error(failed, self.admission.no_engine(req))
        return result

    async def _prefill(self, request: web.Request, req: InferenceRequest, tenant: TenantQuota,
                       rec: RequestRecord, first: Placement,
                       ) -> tuple[InferenceRequest, Engine | None]:
        """A split request's prefill leg, retried on other prefill engines
        (:meth:`gateway.disagg.PrefillLeg.run`); ``first`` is released if it raises."""
        assert first.need is not None
        split_from = self.clock.now()
        try:
            out = await self.prefill_leg.run(
                self.placer.prefill_attempts(first, first.need, self.cfg.gateway.retry_attempts),
                req, request, rec.request_id, first.uncached, first.start_by, first.sheddable)
        except BaseException as e:
            first.release()
            if isinstance(e, asyncio.CancelledError):
                rec.prompt_tokens = req.prompt_tokens  # the prefill engine computed it
            if isinstance(e, LegShed):
                raise self.admission.prefill_shed(tenant, req.model) from e
            raise
        rec.prefill_s = self.clock.now() - split_from
        return out

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
        headers = {**rec.headers(), **placement.headers(prefilled)}
        engine, flight = placement.engine, placement.flight
        # a whole request of a split model: its prompt is prefill queued on the engine
        tracked = req.model in self.split_models and prefilled is None
        async with self.placer.local_prefill(placement, tracked, self.spans) as first_token:
            with self.spans("upstream", kind=SpanKind.CLIENT) as span:
                span.set_attribute("sluice.engine", engine.id)
                upstream = {"x-request-id": rec.request_id}
                if self.spans.enabled:
                    inject_traceparent(upstream)
                result = await self.client.send(
                    engine, req, request, headers, upstream,
                    placement.first_token_hook(first_token),
                    priority=PRIORITIES.index(tenant.priority) if engine.priority_scheduling
                    else None,
                    on_answer=self._remember(tenant, req))
        if flight is not None:
            rec.predicted_ttft_s = flight.predicted_ttft_s
            # what generates nothing (embeddings, scoring) teaches the ledger nothing
            placement.finished(result, learn=prefilled is None and req.generates,
                               streamed=req.stream,  # mix None: the model left
                               mix=self.mix.get(engine.model) if req.generates else None)
        rec.outcome = result.outcome
        rec.ttft_s = None if result.ttft_s is None else (rec.prefill_s or 0.0) + result.ttft_s
        rec.prompt_tokens, rec.completion_tokens = result.prompt_tokens, result.completion_tokens
        rec.finish_reasons = result.finish_reasons
        return result
