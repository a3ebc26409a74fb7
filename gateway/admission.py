"""Admission: the one front door a request passes before its first upstream attempt
(docs/architecture.md, "One request", steps on admission).

:meth:`Admission.admit` checks that an engine is ready and that the request fits the
largest one's KV cache, climbs the degradation ladder (:mod:`limits.degrade`, applying
rungs through :meth:`gateway.openai_api.InferenceRequest.apply`), takes the model's
queue ticket and admits through the queue with the placer as its callback
(:meth:`gateway.placement.Placer.place`, which consults the SLO gate). Every refusal
before the first upstream attempt is raised here or below it (the queue, the placer,
:mod:`limits.slo_gate`); :meth:`Admission.prefill_shed` maps a prefill held at the
gateway past its latest start to the client's error.
"""

from __future__ import annotations

import math

from config.schema import DegradationConfig, EnginesConfig, QueueConfig, TenantQuota
from engines.kinds import accepts_cache_salt
from engines.pool import EnginePool
from engines.prompt import PromptBlocks
from engines.scheduler import SchedRequest
from gateway.openai_api import InferenceRequest
from gateway.placement import Need, Placement, Placer
from gateway.record import RequestRecord
from gateway.tracing import Spans
from limits.admission import AdmissionQueue
from limits.degrade import ladder, shed
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected

#: Retry-After, s, when no engine serving the model is ready (engines restart with
#: backoff starting at 1 s; a few seconds is the honest order of magnitude).
NO_ENGINE_RETRY_S = 5


def salted_models(engines: EnginesConfig) -> set[str]:
    """Models whose every engine accepts vLLM's ``cache_salt`` (when enabled)."""
    return {m for m in engines.model_names()
            if engines.scheduler.prefix.cache_salt
            and all(accepts_cache_salt(s) for s in engines.engines if s.model == m)}


def gone(model: str) -> Rejected:
    """The error of a request for a model a reload removed (queued ones too)."""
    return Rejected(Outcome.MODEL_NOT_FOUND,
                    f"The model '{model}' is no longer served.", param="model")


class Admission:
    """Admits requests for the served models; one per app (the Director's).

    Args:
        engines: the engines' configuration (degradation ladders, ``cache_salt``).
        queue: the admission queues' settings (``default_max_wait_s``).
        pool: the engines.
        placer: engine choice and leases (the queue's callback).
        queues: one admission queue per served model (shared with the Director).
        prompts: tokenizer and block hashes per model.
        clock: monotonic time, s.
        spans: tracing.
        default_output_tokens: a request's output cap when it sets none, tokens.
    """

    def __init__(self, *, engines: EnginesConfig, queue: QueueConfig, pool: EnginePool,
                 placer: Placer, queues: dict[str, AdmissionQueue[Placement]],
                 prompts: PromptBlocks, clock: Clock, spans: Spans,
                 default_output_tokens: int) -> None:
        self.queue_cfg = queue
        self.pool = pool
        self.placer = placer
        self.queues = queues
        self.prompts = prompts
        self.clock = clock
        self.spans = spans
        self.default_output_tokens = default_output_tokens
        self.set_engines(engines)

    def set_engines(self, engines: EnginesConfig) -> None:
        """Each served model's degradation ladder and ``cache_salt`` choice (at start
        and on a reload)."""
        #: each served model's degradation ladder (model_settings builds a pydantic
        #: object per call, too costly per request)
        self._degradation: dict[str, DegradationConfig] = {
            m: engines.model_settings(m).degradation for m in engines.model_names()}
        #: models whose every engine accepts vLLM's ``cache_salt``
        self.salted = salted_models(engines)

    # ------------------------------------------------------------------ sizes

    def kv_tokens(self, req: InferenceRequest) -> int:
        """KV-cache tokens ``req`` may occupy: prompt + output cap (or the default) ×
        sequences; sizes the queue ticket, the KV-block lease and the context check."""
        return req.prompt_tokens + self.output_cap(req) * req.sequences

    def output_cap(self, req: InferenceRequest) -> int:
        """Tokens ``req`` may generate per sequence: its output cap, else the
        gateway's ``default_output_tokens``."""
        cap = req.max_output_tokens
        return self.default_output_tokens if cap is None else cap

    async def measure(self, req: InferenceRequest) -> None:
        """Tokenize the prompt once (off the event loop for a real tokenizer): its
        token count (tools, tool calls and media parts included; exact where the
        model's tokenizer is known and nothing was added) and its blocks."""
        salt = req.body.get("cache_salt") if req.model in self.salted else None
        assert req.prompt is not None
        m = await self.prompts.measure(req.model, req.prompt, salt, large=req.large)
        req.measured(m.tokens, m.blocks, exact=m.exact)

    def need(self, req: InferenceRequest, tenant: TenantQuota, arrived: float,
             session_id: str | None) -> Need:
        sched = SchedRequest(model=req.model, tenant=tenant.name,
                             prompt_tokens=req.prompt_tokens, priority=tenant.priority,
                             blocks=req.blocks, block_size=self.prompts.block_size(req.model),
                             session_id=session_id)
        return Need(sched, tenant.priority, self.kv_tokens(req), arrived=arrived,
                    splittable=req.sequences == 1 and req.endpoint in ("chat", "completions"),
                    output_tokens=self.output_cap(req), streamed=req.stream)

    # ------------------------------------------------------------------ refusals

    def no_engine(self, req: InferenceRequest) -> Rejected:
        return Rejected(Outcome.NO_ENGINE,
                        f"No engine serving '{req.model}' is ready; retry shortly.",
                        retry_after_s=NO_ENGINE_RETRY_S)

    def prefill_shed(self, tenant: TenantQuota, model: str) -> Rejected:
        """The error of a request whose prefill was held at the gateway past its
        latest start (:class:`gateway.prefill_queue.LegShed`):
        :meth:`limits.slo_gate.SloGate.prefill_shed`."""
        return self.placer.gate.prefill_shed(model, tenant.priority)

    # ------------------------------------------------------------------ the door

    async def admit(self, req: InferenceRequest, tenant: TenantQuota, rec: RequestRecord, *,
                    arrived: float, timeout_s: float | None,
                    session_id: str | None) -> Placement:
        """Admit ``req`` (already measured and within the tenant's caps) and return
        its first placement (its :class:`~gateway.placement.Need` attached). A
        degradation rung may change ``req`` in place (a lower output cap, a fallback
        model, re-measured with its own tokenizer); ``rec`` gets the rungs climbed
        and the queue wait. ``arrived``: clock time it reached the gateway, s;
        ``timeout_s``: the client's ``x-request-timeout``, s.

        Raises:
            Rejected: ``no_engine``; ``context_length_exceeded`` (larger than every
                ready engine's KV cache); ``overloaded`` (``shed`` by the ladder,
                ``predicted_miss`` by the SLO gate, queue full); ``queue_timeout``;
                ``model_not_found`` (the model left with a reload while queued).
        """
        ready = [e for e in self.pool.for_model(req.model) if e.routable]
        if not ready:
            raise self.no_engine(req)
        capacity = [c for e in ready if (c := e.kv_capacity_tokens)]
        kv = self.kv_tokens(req)
        if capacity and len(capacity) == len(ready) and kv > max(capacity):
            raise Rejected(Outcome.CONTEXT_LENGTH_EXCEEDED,
                           f"This request needs about {kv} tokens of KV cache (prompt + max "
                           f"output × sequences); the largest engine holds {max(capacity)}.",
                           param=req.prompt_param)
        max_wait = min(tenant.max_queue_wait_s or self.queue_cfg.default_max_wait_s,
                       timeout_s or math.inf)
        # at best effort the deadline bounds the answer: the wait leaves room for the run
        bound = self.placer.best_effort_wait_s(req.model, tenant.priority, max_wait)
        if bound is not None:
            timeout_s = max_wait = bound
        model = req.model
        self.placer.gate.arrived(model, tenant.priority)
        self._degrade(req, tenant, rec, max_wait)
        if req.model != model:  # a fallback model: its own tokenizer and blocks
            await self.measure(req)
        need = self.need(req, tenant, arrived, session_id)
        queue = self.queues[req.model]
        ticket = queue.ticket(tenant, need.tokens, request_id=rec.request_id,
                              timeout_s=timeout_s)
        with self.spans("queue.wait") as span:
            span.set_attribute("sluice.priority", tenant.priority)
            span.set_attribute("sluice.queue_depth", len(queue))
            waited_from = self.clock.now()
            try:
                return await queue.admit(ticket, lambda _t: self.placer.place(need),
                                         Placement.release)
            finally:
                rec.queue_s = self.clock.now() - waited_from

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
                req.model, tenant.priority, self.kv_tokens(req))

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
