"""The per-request pipeline (DESIGN.md, "Request flow"): parse → checks → place →
proxy (retrying on another engine only before the first byte) → finish.

Everything a request acquires is released in ``finally``, exactly once, whether it
ends in success, error, timeout or client disconnect.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from config.schema import Config, TenantQuota
from engines.pool import Engine, EnginePool
from engines.scheduler import Decision, SchedRequest, Scheduler
from gateway.keys import REQUEST_ID, TENANT
from gateway.openai_api import Endpoint, InferenceRequest, parse_json, parse_request
from gateway.proxy import EngineClient, ProxyResult, UpstreamFailed
from limits.outcome import Outcome, Rejected

#: Retry-After, s, when no engine serving the model is ready (engines restart with
#: backoff starting at 1 s; a few seconds is the honest order of magnitude).
NO_ENGINE_RETRY_S = 5


@dataclass
class RequestRecord:
    """What the pipeline learned about one request (for logs and metrics)."""

    request_id: str
    tenant: str
    model: str | None = None
    engine: str | None = None
    outcome: Outcome = Outcome.OK
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    started: float = field(default_factory=time.perf_counter)


class Director:
    """Runs requests through the pipeline; one per app."""

    def __init__(self, cfg: Config, pool: EnginePool, scheduler: Scheduler,
                 client: EngineClient) -> None:
        self.cfg = cfg
        self.pool = pool
        self.scheduler = scheduler
        self.client = client
        self.models = set(cfg.engines.model_names())

    # ------------------------------------------------------------------ checks

    def _check_model(self, tenant: TenantQuota, req: InferenceRequest) -> None:
        allowed = tenant.allowed_models
        if req.model not in self.models or (allowed is not None and req.model not in allowed):
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

    # ------------------------------------------------------------------ placement

    def _pick(self, req: InferenceRequest, tenant: TenantQuota,
              exclude: set[str]) -> Decision | None:
        candidates = [e for e in self.pool.for_model(req.model) if e.id not in exclude]
        sreq = SchedRequest(model=req.model, tenant=tenant.name,
                            prompt_tokens=req.prompt_tokens, priority=tenant.priority)
        return self.scheduler.pick(sreq, candidates, time.monotonic())

    def _no_engine(self, req: InferenceRequest) -> Rejected:
        return Rejected(Outcome.NO_ENGINE,
                        f"No engine serving '{req.model}' is ready; retry shortly.",
                        retry_after_s=NO_ENGINE_RETRY_S)

    # ------------------------------------------------------------------ pipeline

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        tenant = request[TENANT]
        rec = RequestRecord(request_id=request[REQUEST_ID], tenant=tenant.name)
        try:
            req = parse_request(endpoint, parse_json(await request.read()))
            rec.model = req.model
            self._check_model(tenant, req)
            self._apply_tenant_caps(tenant, req)
            result = await self._dispatch(request, req, tenant, rec)
            rec.outcome = result.outcome
            rec.prompt_tokens, rec.completion_tokens = result.prompt_tokens, result.completion_tokens
            rec.ttft_s = result.ttft_s
            return result.response
        except Rejected as rej:
            rec.outcome = rej.outcome
            raise

    async def _dispatch(self, request: web.Request, req: InferenceRequest,
                        tenant: TenantQuota, rec: RequestRecord) -> ProxyResult:
        tried: set[str] = set()
        last: UpstreamFailed | None = None
        for _ in range(self.cfg.gateway.retry_attempts):
            decision = self._pick(req, tenant, tried)
            if decision is None:
                break
            engine: Engine = decision.engine
            rec.engine = engine.id
            headers = {"x-request-id": rec.request_id, "x-sluice-engine": engine.id}
            with self.pool.lease(engine):
                try:
                    return await self.client.send(engine, req, request, headers,
                                                  {"x-request-id": rec.request_id})
                except UpstreamFailed as failed:
                    last = failed
                    tried.add(engine.id)
                    if not failed.retryable:
                        break
        if last is None:
            raise self._no_engine(req)
        if last.outcome is Outcome.UPSTREAM_TIMEOUT:
            raise Rejected(Outcome.UPSTREAM_TIMEOUT, "The engine did not answer in time.")
        if last.outcome is Outcome.NO_ENGINE:
            raise self._no_engine(req)
        raise Rejected(Outcome.UPSTREAM_ERROR, "The engine failed to answer; retry shortly.")
