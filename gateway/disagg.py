"""Prefill–decode disaggregation in the gateway: whether to split a request, onto
which pair of engines, and the two legs of a split request.

The design follows DistServe (Zhong et al., OSDI 2024), Splitwise (Patel et al.,
ISCA 2024) and Mooncake (Qin et al., FAST 2025): long prefills stall the decode steps
of every request batched with them, so prefill runs on prefill engines and the KV
cache moves to a decode engine. The protocol is vLLM's (its NIXL proxy,
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``):

1. **Prefill leg** to a ``role: prefill`` engine: the client's body with ``stream:
   false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when present), no
   ``stream_options``, no ``min_tokens``/``min_completion_tokens``, and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
   "remote_port": null}``. Its answer's ``kv_transfer_params`` say where the blocks
   wait.
2. **Decode leg** to a ``role: decode`` (or ``both``) engine: the client's body plus
   those ``kv_transfer_params``, streamed back to the client. Both legs carry the
   same ``X-Request-Id``.

The choice (:meth:`Disaggregator.choose`), per request, among running the whole
request on a decode engine d ("local") or splitting it over a prefill engine p and
a decode engine d, from an explicit prediction of TTFT, s::

    local(d)    = wait(d, uncached(d)) + uncached(d) × c(d)
    split(p, d) = wait(p, uncached(p)) + uncached(p) × c(p)
                  + transfer(prompt − cached(d)) + outstanding(d) × c(d)

where ``uncached(e)`` is the prompt less the leading blocks the prefix index says
``e`` holds, ``outstanding(e)`` the prompt tokens this gateway has sent to ``e``
that have not produced their first token yet, ``wait(e, n)`` = ``c(e)`` × those
plus the prefills of at most ``n`` tokens held at the gateway for ``e`` (they leave
before this one: :meth:`gateway.prefill_queue.PrefillQueue.wait_s`), ``c(e)`` the
engine's observed seconds per prefill token (:class:`PrefillSpeed`), and transfer
time ``tokens × kv_bytes_per_token × 8 / (transfer_gbps × 10⁹)``. The sooner option
wins (ties: the decode engine with fewer requests in flight).

The TPOT side is a per-step budget. vLLM's chunked prefill puts the waiting prompt
tokens into the next step (up to ``max_num_batched_tokens``), and every stream
decoding on the engine waits for that step; so a step that carries ``P`` prefill
tokens stretches each of their inter-token gaps by ``b2 × P`` (the latency model's
prefill interference per token). Sarathi-Serve (Agrawal et al., OSDI 2024, §4) sizes
the token budget of a step from the TBT SLO; here a decode engine's step may carry
:meth:`Disaggregator.step_tokens`: the prompt tokens that keep TPOT̂ at its batch
within the tightest TPOT target, ``(τ − b0 − b1 × (batch + 1)) / b2``, or that add
``max_decode_stall_ms`` to a step when it is set. A local prefill is offered only
where the prompt fits that budget in one step (or the engine has nothing in flight:
nobody to stall), and it is sent only when it fits beside the prefill already
outstanding there (``gateway.prefill_queue``: held at the gateway until then,
shortest first within the deadlines). So every step on a decode engine stays within
the TPOT target, a short prompt or one already cached on a decode engine skips the
prefill leg, and in a burst the decode engines take prefill work up to what their
streams can bear. The ``threshold`` policy (the baseline of public routers) splits
exactly the prompts of at least ``threshold_tokens`` (estimated) tokens over the
same pair the prediction would choose, and runs the others on a decode engine at
once.

The TTFT estimate is this module's own (load the gateway sees plus observed prefill
speeds), not the learned latency model, which gives only the decode step. With
adaptive admission the decode lease holds a flight in the decode engine's latency
ledger like a whole request; a decode leg computes none of the prompt there (vLLM
counts the loaded tokens as ``vllm:external_prefix_cache_hits``, which the latency
model does not take for prefill), so its TTFT rule counts only the prefill queued
ahead of it. And with adaptive admission the chosen option's TTFT̂ is also the
shedding rule (:meth:`gateway.placement.Placer._sheddable`): a request it predicts
to start past its TTFT budget is shed (``predicted_miss``) rather than queued behind
prefills that can still make their targets — once both engines' speeds are observed
(:attr:`Choice.observed`) and unless the prompt alone (:attr:`Choice.alone_s`) would
miss the target anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from opentelemetry.trace import SpanKind

from config.schema import DisaggregationConfig, EnginesConfig
from engines.pool import Engine, EngineLease
from gateway.attempts import first_success
from gateway.openai_api import InferenceRequest
from gateway.prefill_queue import PrefillQueue
from gateway.proxy import EngineClient
from gateway.tracing import Spans, inject_traceparent
from limits.clock import MONOTONIC
from limits.interfaces import Clock
from limits.slo_gate import SloGate

#: ``kv_transfer_params`` of the prefill leg, as vLLM's proxy sends them.
PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: Fields vLLM's proxy removes from the prefill leg (not supported there).
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
#: Weight of a new observation in the prefill-speed EWMA.
EWMA_ALPHA = 0.2
#: Observations of fewer tokens are dominated by per-step overhead and skipped.
MIN_SAMPLE_TOKENS = 256


def role(engine: Engine) -> str:
    """The engine's configured role: ``prefill``, ``decode`` or ``both``."""
    return engine.labels.get("role", "both")


def serves_whole(engine: Engine) -> bool:
    """Whether whole (unsplit) requests and decode legs may go to ``engine``."""
    return role(engine) != "prefill"


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body from the client's (see the module docstring)."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's plus the prefill engine's
    ``kv_transfer_params`` (as vLLM's proxy, only when it returned some)."""
    out = dict(body)
    if params:
        out["kv_transfer_params"] = dict(params)
    return out


@dataclass
class PrefillSpeed:
    """Per engine: prompt tokens sent and not yet past their first token, and an
    EWMA of observed seconds per prefill token.

    An observation is one prefill (a prefill leg's answer or a whole request's first
    token): ``elapsed_s / (tokens ahead of it + its own tokens)``, the queue it found
    included, so the estimate needs no engine profile. ``clock``: monotonic time, s.
    """

    prior_s_per_token: float
    clock: Clock = MONOTONIC
    outstanding: dict[str, int] = field(default_factory=dict)
    s_per_token: dict[str, float] = field(default_factory=dict)

    def c(self, engine: Engine) -> float:
        """Seconds per prefill token on ``engine``."""
        return self.s_per_token.get(engine.id, self.prior_s_per_token)

    def observed(self, engine: Engine) -> bool:
        """Whether :meth:`c` of ``engine`` is observed rather than the prior."""
        return engine.id in self.s_per_token

    def wait_s(self, engine: Engine) -> float:
        """Predicted wait before a new prefill starts on ``engine``, s."""
        return self.outstanding.get(engine.id, 0) * self.c(engine)

    def start(self, engine: Engine, tokens: int) -> int:
        """A prefill of ``tokens`` was sent; returns the tokens it queues behind."""
        ahead = self.outstanding.get(engine.id, 0)
        self.outstanding[engine.id] = ahead + tokens
        return ahead

    @contextmanager
    def track(self, engine: Engine, tokens: int) -> Iterator[Callable[[], None]]:
        """:meth:`start` a prefill of ``tokens`` on ``engine`` for the ``with`` block;
        yields the callback to call at its first token (:meth:`done` with the time
        taken); leaving the block without it ends the prefill unobserved."""
        ahead, t0 = self.start(engine, tokens), self.clock.now()
        finished = False

        def first_token() -> None:
            nonlocal finished
            if not finished:
                finished = True
                self.done(engine, tokens, ahead, self.clock.now() - t0)

        try:
            yield first_token
        finally:
            if not finished:
                self.done(engine, tokens, ahead, None)

    def forget(self, engine_id: str) -> None:
        """Drop what is known of an engine that left the pool."""
        self.outstanding.pop(engine_id, None)
        self.s_per_token.pop(engine_id, None)

    def done(self, engine: Engine, tokens: int, ahead: int, elapsed_s: float | None) -> None:
        """The prefill :meth:`start` ed with these ``tokens`` and ``ahead`` ended
        after ``elapsed_s`` (None: it failed or was cancelled; no observation)."""
        self.outstanding[engine.id] = max(0, self.outstanding.get(engine.id, 0) - tokens)
        total = ahead + tokens
        if elapsed_s is not None and total >= MIN_SAMPLE_TOKENS:
            old = self.c(engine)
            self.s_per_token[engine.id] = old + EWMA_ALPHA * (elapsed_s / total - old)


@dataclass(frozen=True)
class Choice:
    """Where one request runs.

    Attributes:
        decode: the engine that streams the answer (the whole request when
            ``prefill`` is None).
        prefill: the prefill leg's engine, or None (not split).
        ttft_s: the predicted TTFT of this option, s.
        uncached: prompt tokens the first engine must compute (prefill's when
            split), tokens.
        alone_s: the predicted TTFT of this option with no prefill queued ahead of
            it, s.
        observed: the prefill speeds of its engines are observed ones, not the
            configured prior.
    """

    decode: Engine
    prefill: Engine | None
    ttft_s: float
    uncached: int
    alone_s: float
    observed: bool



def split_models(engines: EnginesConfig) -> frozenset[str]:
    """Models with prefill engines (prefill–decode disaggregation)."""
    return frozenset(s.model for s in engines.engines if s.role == "prefill")


class Disaggregator:
    """Chooses split or local per request (module docstring).

    Args:
        cfg: the ``disaggregation`` section.
        clock: monotonic time, s, for the prefill-speed observations
            (:attr:`speed`, which the legs update).
        tpot_target_s: the tightest TPOT target of the SLO bands, s (the decode
            engines' step budget, :meth:`step_tokens`).
        gate: the SLO gate whose ledgers' latency models price a decode engine's step
            budget (the placer sets it; None: the observed prefill speed only).
    """

    def __init__(self, cfg: DisaggregationConfig, clock: Clock = MONOTONIC, *,
                 tpot_target_s: float = 0.1, gate: SloGate | None = None) -> None:
        self.cfg = cfg
        self.tpot_target_s = tpot_target_s
        self.gate = gate
        self.speed = PrefillSpeed(1.0 / cfg.prefill_tokens_per_s, clock)
        #: prefills held at the gateway: split requests' legs per prefill engine, and
        #: (``predicted`` policy) local prefills per decode engine
        self.queue = PrefillQueue(self.speed.outstanding, self.speed.c, clock,
                                  hold_tokens=cfg.prefill_hold_tokens,
                                  step_tokens=self.step_tokens)
        bits = (cfg.kv_bytes_per_token or 0) * 8
        #: predicted transfer time per token, s
        self.transfer_s_per_token = bits / (cfg.transfer_gbps * 1e9)

    @staticmethod
    def applies(engines: Iterable[Engine]) -> bool:
        """Whether a model served by ``engines`` has prefill engines at all."""
        return any(role(e) == "prefill" for e in engines)

    @property
    def holds_local(self) -> bool:
        """Whether whole requests' prefills on decode engines go through
        :attr:`queue` (the ``predicted`` policy; the ``threshold`` baseline sends
        them at once)."""
        return self.cfg.policy == "predicted"

    def step_tokens(self, engine: Engine) -> float | None:
        """The uncached prompt tokens one step of decode engine ``engine`` may carry
        (module docstring; :attr:`queue`'s budget): its trusted latency model's
        :meth:`~limits.latency_model.LatencyModel.prefill_budget` for
        :attr:`tpot_target_s` at its batch + 1 (or for ``max_decode_stall_ms`` when
        set); without one, that target (or stall) over the engine's observed seconds
        per prefill token (:class:`PrefillSpeed`, an upper bound: it counts the
        fixed part of the step too). None for a prefill engine (held by
        ``prefill_hold_tokens`` instead)."""
        if role(engine) == "prefill":
            return None
        stall_ms = self.cfg.max_decode_stall_ms
        stall_s = None if stall_ms is None else stall_ms / 1000.0
        ledger = None if self.gate is None else self.gate.ledger(engine.id)
        if ledger is not None and ledger.model.confident:
            budget = ledger.model.prefill_budget(self.tpot_target_s, ledger.decoding + 1,
                                                 stall_s)
            if budget is not None:
                return budget
        return (self.tpot_target_s if stall_s is None else stall_s) / self.speed.c(engine)

    def choose(self, prompt_tokens: int, cached: Mapping[str, int],
               decode: Sequence[Engine], prefill: Sequence[Engine]) -> Choice | None:
        """The option for a request of ``prompt_tokens`` (estimated) tokens: the
        soonest allowed one (module docstring).

        Args:
            cached: engine id → leading prompt tokens it holds (prefix index).
            decode: candidate engines for a whole request or a decode leg (admitting
                now); prefill: candidate prefill engines (admitting now).

        Returns None when ``decode`` is empty.
        """
        best: tuple[tuple[float, int], Choice] | None = None

        def offer(choice: Choice) -> None:
            nonlocal best
            key = (choice.ttft_s, choice.decode.in_flight)
            if best is None or key < best[0]:
                best = (key, choice)

        predicted = self.cfg.policy == "predicted"
        split_wanted = bool(prefill) and (predicted
                                          or prompt_tokens >= self.cfg.threshold_tokens)
        legs: dict[str, tuple[int, float]] = {}  # prefill engine → its tokens, its wait (s)
        for p in prefill if split_wanted else ():
            n = max(1, prompt_tokens - cached.get(p.id, 0))
            legs[p.id] = (n, self.queue.wait_s(p, n))
        for d in decode:
            wait_d = self.speed.wait_s(d)
            uncached_d = max(1, prompt_tokens - cached.get(d.id, 0))
            local_s = uncached_d * self.speed.c(d)
            if not split_wanted:
                offer(Choice(d, None, wait_d + local_s, uncached_d, local_s,
                             self.speed.observed(d)))
                continue
            if predicted and (d.in_flight == 0 or uncached_d <= (self.step_tokens(d) or 0)):
                offer(Choice(d, None, self.queue.wait_s(d, uncached_d) + local_s,
                             uncached_d, local_s, self.speed.observed(d)))
            moved_s = (prompt_tokens - cached.get(d.id, 0)) * self.transfer_s_per_token
            for p in prefill:
                if p is d:
                    continue
                uncached_p, wait_p = legs[p.id]
                alone = uncached_p * self.speed.c(p) + moved_s
                offer(Choice(d, p, wait_p + alone + wait_d, uncached_p, alone,
                             self.speed.observed(p) and self.speed.observed(d)))
        return best[1] if best is not None else None


class PrefillLeg:
    """Runs split requests' prefill legs, each through the prefill engine's
    :class:`~gateway.prefill_queue.PrefillQueue`, and keeps :class:`PrefillSpeed` up to
    date.

    Args:
        client: the gateway's engine client.
        disagg: the choice whose estimates and queue the legs use.
        spans: tracing.
    """

    def __init__(self, client: EngineClient, disagg: Disaggregator, spans: Spans) -> None:
        self.client = client
        self.speed = disagg.speed
        self.queue = disagg.queue
        self.spans = spans

    async def run(self, attempts: Iterable[EngineLease], req: InferenceRequest,
                  request: web.Request, request_id: str, uncached: int,
                  start_by: float = math.inf,
                  sheddable: bool = False) -> tuple[InferenceRequest, Engine | None]:
        """Run ``req``'s prefill leg on the first of ``attempts`` (prefill leases,
        :meth:`gateway.placement.Placer.prefill_attempts`), on the next after a
        retryable failure. Returns the decode leg's request (the client's body plus
        the returned ``kv_transfer_params``) and the engine that prefilled; or the
        client's request and None when every attempt failed, so the decode engine
        prefills itself. Each lease is released when its leg ends. ``start_by`` (clock
        time, s) and ``sheddable``: the leg's latest start and whether it is shed past
        it while held (:class:`~gateway.prefill_queue.PrefillQueue`).

        Raises:
            LegShed: the leg was held past its latest start and shed.
            Rejected: the engine rejected the request (4xx).
            asyncio.CancelledError: the client went away; the leg's connection is
                closed, which aborts it on the engine.
        """
        async def send(lease: EngineLease) -> tuple[InferenceRequest, Engine | None]:
            return await self._send(lease.engine, req, request, request_id, uncached,
                                    start_by, sheddable), lease.engine

        done, _ = await first_success(attempts, send)
        return done or (req, None)

    async def _send(self, engine: Engine, req: InferenceRequest, request: web.Request,
                    request_id: str, uncached: int, start_by: float,
                    sheddable: bool) -> InferenceRequest:
        leg = replace(req, body=prefill_body(req.body), stream=False, client_usage=False)
        with self.spans("queue.prefill"):
            counted = await self.queue.admit(engine, uncached, start_by, sheddable)
        with self.spans("upstream.prefill", kind=SpanKind.CLIENT) as span:
            span.set_attribute("sluice.engine", engine.id)
            upstream = {"x-request-id": request_id}
            if self.spans.enabled:
                inject_traceparent(upstream)
            try:
                with self.speed.track(engine, uncached) as first_token:
                    counted()

                    def computed() -> None:
                        first_token()
                        self.queue.release(engine)
                    result = await self.client.send(engine, leg, request, {}, upstream,
                                                    computed)
            finally:
                counted()
                self.queue.release(engine)
        params = (result.answer or {}).get("kv_transfer_params")
        return replace(req, body=decode_body(req.body, params if isinstance(params, dict) else None))
