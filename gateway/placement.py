"""Placing one request on an engine: the candidates with room, the scheduler's pick,
and the engine lease it holds while the upstream call runs.

:class:`Placer` is synchronous and non-blocking (the admission queue calls
:meth:`Placer.place` while deciding which ticket goes next). A retry on another
engine before the first byte is an iteration over :meth:`Placer.attempts`: each
attempt is a fresh :class:`Placement` that excludes the engines already tried.

For a model with ``role: prefill`` engines the first placement is the
disaggregation choice (:mod:`gateway.disagg`): a lease on the decode engine and,
when the request is split, one on its prefill engine; retries of the prefill leg
iterate over :meth:`Placer.prefill_attempts`. Whole requests and decode legs go only
to engines of role ``decode`` or ``both``.

With adaptive admission (``saturation.adaptive``), an engine with room must also be
predicted to serve the request within its band's SLO (the SLO gate,
:mod:`limits.slo_gate`) — for an engine that reports no KV-cache usage this learned
limit is the whole admission (``limits.saturation`` then caps it only at the
engine's slots) — and each placement holds a :class:`~limits.engine_latency.Flight`
in the gate's ledger of its engine, which the placement feeds
(:meth:`Placement.first_token`, :meth:`Placement.finished`) and its release closes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from config.schema import AdaptiveConfig, Priority, SloConfig
from engines.kinds import KINDS
from engines.plugins import engine_load
from engines.pool import Engine, EngineLease, EnginePool
from engines.scheduler import SchedRequest, Scheduler
from gateway.disagg import Disaggregator, role, serves_whole
from gateway.tracing import Spans
from limits.capacity import MixTracker
from limits.engine_latency import Flight
from limits.interfaces import Clock, ReadyEngine
from limits.outcome import Outcome
from limits.saturation import SaturationDetector, kv_blocks
from limits.slo_gate import SloGate

if TYPE_CHECKING:
    from gateway.proxy import ProxyResult

#: Response header naming a split request's prefill engine (``x-sluice-engine``
#: names the engine that streamed the answer).
PREFILL_ENGINE_HEADER = "x-sluice-prefill-engine"
#: Response header: prompt tokens the prefix index predicted cached on the chosen
#: engine, per index (``events=N, approximate=M``); the replay benchmark compares it
#: with the engine's ``usage.prompt_tokens_details.cached_tokens``.
PREFIX_TOKENS_HEADER = "x-sluice-prefix-tokens"


def _call_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()


@dataclass(eq=False)
class Placement:
    """One request's engine: its lease (one in-flight slot and ``lease.blocks``
    promised KV blocks, released exactly once) and the scheduler's scores and
    prefix prediction (:attr:`engines.scheduler.Decision.prefix_tokens`).

    ``async with placement:`` releases the lease on exit; :meth:`release` is
    idempotent, so the admission queue's undo and the exit may both run.

    A split request also holds ``prefill``, the lease on its prefill engine (the
    prompt's blocks), until its prefill leg ends. A request of a split model has its
    prefill's latest start ``start_by`` (clock time, s: placement + TTFT budget − the
    option's time alone) and whether it is shed past it while held (``sheddable``:
    :class:`gateway.prefill_queue.PrefillQueue`: the prefill leg's, or the local
    prefill's on the decode engine, which waits in that queue when ``hold_local``);
    ``uncached`` is the prompt tokens the first engine is predicted to compute;
    ``need`` what it was placed for (its retries place the same). With
    adaptive admission, ``flight`` is the request's entry in ``gate``'s ledger of the
    engine, which :meth:`first_token` and :meth:`finished` feed, and ``on_release``
    closes it (once, on the first :meth:`release`).
    """

    lease: EngineLease
    scores: dict[str, float] = field(default_factory=dict)
    prefill: EngineLease | None = None
    uncached: int = 0
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    flight: Flight | None = None
    on_release: Callable[[Placement], None] | None = None
    start_by: float = math.inf
    sheddable: bool = False
    hold_local: bool = False
    gate: SloGate | None = None
    need: Need | None = None

    @property
    def engine(self) -> Engine:
        return self.lease.engine

    def headers(self, prefilled: Engine | None) -> dict[str, str]:
        """The response headers this placement answers with: ``x-sluice-engine``,
        :data:`PREFILL_ENGINE_HEADER` (``prefilled``: a split request's prefill
        engine), :data:`PREFIX_TOKENS_HEADER` and ``x-sluice-ttft-predicted-ms`` (the
        flight's TTFT̂) where there are such."""
        out = {"x-sluice-engine": self.engine.id}
        if prefilled is not None:
            out[PREFILL_ENGINE_HEADER] = prefilled.id
        if self.prefix_tokens:
            out[PREFIX_TOKENS_HEADER] = ", ".join(
                f"{k}={v}" for k, v in self.prefix_tokens.items())
        if self.flight is not None:
            out["x-sluice-ttft-predicted-ms"] = f"{self.flight.predicted_ttft_s * 1000:.1f}"
        return out

    def first_token_hook(self, also: Callable[[], None] | None,
                         ) -> Callable[[], None] | None:
        """What the proxy calls at the answer's first token: ``also`` (the local
        prefill's tracking, :meth:`Placer.local_prefill`) and :meth:`first_token`
        where there is a flight; None when neither."""
        hooks = [f for f in (also, None if self.flight is None else self.first_token)
                 if f is not None]
        return None if not hooks else functools.partial(_call_all, hooks)

    def first_token(self) -> None:
        """The engine streamed the answer's first token now (the flight's TTFT)."""
        if self.flight is not None and self.gate is not None:
            self.gate.first_token(self.engine.id, self.flight)

    def finished(self, result: ProxyResult, *, learn: bool, streamed: bool,
                 mix: MixTracker | None) -> None:
        """The upstream call ended with ``result``: the flight's usage and end go to
        the ledger (which learns from them only when ``learn``: a whole request that
        succeeded), and a successful answer's prompt, uncached prompt and output
        tokens join ``mix`` (the model's request mix for the capacity report; None:
        the model left with a reload). Nothing without a flight."""
        flight = self.flight
        if flight is None or self.gate is None:
            return
        ok = result.outcome is Outcome.OK
        self.gate.finished(self.engine.id, flight, completion_tokens=result.completion_tokens,
                           prompt_tokens=result.prompt_tokens,
                           cached_tokens=result.cached_tokens, ok=ok and learn,
                           streamed=streamed)
        if ok and mix is not None:
            uncached = flight.uncached_tokens if result.cached_tokens is None \
                else max(0, result.prompt_tokens - result.cached_tokens)
            mix.observe(result.prompt_tokens, uncached, result.completion_tokens)

    @property
    def blocks(self) -> int:
        return self.lease.blocks

    def release(self) -> None:
        if self.on_release is not None:
            done, self.on_release = self.on_release, None
            done(self)
        self.lease.release()
        if self.prefill is not None:
            self.prefill.release()

    async def __aenter__(self) -> Placement:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Need:
    """What one request asks of an engine.

    Attributes:
        sched: the scheduler's view (model, prompt blocks, session…).
        priority: the tenant's priority (the saturation check's reserve).
        tokens: KV-cache tokens it may occupy: prompt + output cap × sequences.
        splittable: may be split into prefill and decode legs (one sequence: the
            connector protocol carries one).
        output_tokens: its output cap (or the default one), tokens per sequence; 0:
            not known. Prices its predicted time on an engine (the urgent bands'
            room, :class:`~limits.band_demand.BandDemand`).
        arrived: clock time it reached the gateway, s (its TTFT target counts from
            there); None: no SLO check.
        streamed: the engine's answer streams (its first token is seen); False: it
            comes whole (the ledger then takes the prefill as done at TTFT̂ + z σ).
    """

    sched: SchedRequest
    priority: Priority
    tokens: int
    splittable: bool = True
    arrived: float | None = None
    output_tokens: int = 0
    streamed: bool = True


class Placer:
    """Chooses engines with room and takes their leases.

    Args:
        pool: the engines and their leases.
        scheduler: picks one engine among the candidates and records dispatches.
        detector: whether an engine has room for a request (KV blocks, in-flight cap).
        clock: monotonic time, s (the metrics snapshots' clock).
        disagg: the split choice, for the models in ``split_models`` (those with
            prefill engines).
        slo: the per-band targets.
        adaptive: the adaptive admission's settings; when enabled every engine of the
            pool gets a latency ledger in the gate.
        retry_after: model → ``Retry-After`` s for a ``predicted_miss`` shed.
        gate: the SLO gate (one is built from ``slo``, ``adaptive`` and
            ``retry_after`` when None). The placer gives it the pool's scraped
            counters and the scheduler its view.
    """

    def __init__(self, *, pool: EnginePool, scheduler: Scheduler,
                 detector: SaturationDetector, clock: Clock,
                 disagg: Disaggregator | None = None,
                 split_models: frozenset[str] = frozenset(),
                 slo: SloConfig | None = None, adaptive: AdaptiveConfig | None = None,
                 retry_after: Callable[[str], int] = lambda m: 1,
                 gate: SloGate | None = None) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.detector = detector
        self.clock = clock
        self.disagg = disagg
        self.split_models = split_models if disagg is not None else frozenset()
        self.gate = gate or SloGate(slo=slo, adaptive=adaptive, clock=clock,
                                    retry_after=retry_after)
        self.slo: SloConfig = self.gate.slo
        self.adaptive: AdaptiveConfig = self.gate.adaptive
        if self.adaptive.enabled:
            scheduler.slo = self.gate
        if disagg is not None:
            disagg.gate = self.gate
        pool.on_counters.append(self.gate.scraped)
        for e in pool.engines:
            self.track(e)

    def track(self, engine: Engine) -> None:
        """Give an engine of the pool its latency ledger (with adaptive admission)."""
        self.gate.track(engine.id, self._unmetered_limit(engine))

    def _unmetered_limit(self, engine: Engine) -> int | None:
        """Where the fallback limiter of an engine whose dialect reports no KV-cache
        usage (llama.cpp, TGI, a bare OpenAI server) starts: its learned limit is all
        that admits it, so at ``saturation.unmetered_max_in_flight``, the fixed cap it
        would have without adaptive admission. None (the default limiter) for
        others."""
        kind = KINDS.get(engine.labels.get("dialect", "vllm"))
        if kind is None or "kv_usage" in kind.signals:
            return None
        return self.detector.unmetered_max_in_flight

    def forget(self, engine: Engine) -> None:
        """An engine left the pool: drop its prefill-speed estimate and its latency
        ledger."""
        self.gate.forget(engine.id)
        if self.disagg is not None:
            self.disagg.speed.forget(engine.id)
            self.disagg.queue.forget(engine.id)

    def candidates(self, model: str, priority: Priority, tokens: int,
                   exclude: frozenset[str] = frozenset(), *,
                   prefill: bool = False) -> list[Engine]:
        """Ready engines of ``model`` not in ``exclude`` with room for ``tokens``:
        of role ``prefill`` for a prefill leg, else of role ``decode`` or ``both``."""
        now = self.clock.now()
        return [e for e in self.pool.for_model(model)
                if e.routable and e.id not in exclude
                and (role(e) == "prefill" if prefill else serves_whole(e))
                and self.detector.admits(e, priority, tokens, now)]

    def uncached(self, engine: Engine, sched: SchedRequest, now: float) -> int:
        """Prompt tokens ``engine`` must compute for ``sched``: the prompt less the
        leading blocks its prefix index says the engine holds."""
        hit = self.scheduler.index.match(engine, sched.blocks, now) if sched.blocks else 0
        return max(0, sched.prompt_tokens - hit * sched.block_size)

    def ttft_budget_s(self, need: Need, now: float) -> float:
        """Time left at clock time ``now`` before ``need``'s TTFT target, s
        (:meth:`limits.slo_gate.SloGate.ttft_budget_s`)."""
        return self.gate.ttft_budget_s(need.priority, need.arrived, now)

    def best_effort_wait_s(self, model: str, priority: Priority,
                           max_wait_s: float) -> float | None:
        """:meth:`limits.slo_gate.SloGate.best_effort_wait_s` over the ready engines
        serving whole requests of ``model``."""
        ready = [e.id for e in self.pool.for_model(model) if e.routable and serves_whole(e)]
        return self.gate.best_effort_wait_s(model, priority, max_wait_s, ready)

    def within_slo(self, engines: list[Engine], need: Need, now: float,
                   prefill: Sequence[Engine] = ()) -> list[Engine]:
        """The engines among ``engines`` (candidates of :meth:`candidates`, so ready
        ones) the SLO gate admits ``need`` on (:meth:`limits.slo_gate.SloGate.admit`),
        in their order. ``prefill``: the prefill engines with room for a request that
        may be split (then no engine here computes its prompt; empty otherwise).

        Raises:
            Rejected: ``predicted_miss``, as :meth:`~limits.slo_gate.SloGate.admit`.
        """
        assert need.arrived is not None
        model = need.sched.model
        ready = [e for e in self.pool.for_model(model) if e.routable and serves_whole(e)]
        by_id = {e.id: e for e in ready}

        # a request one of the ``prefill`` engines can take computes none of its prompt
        # on the decode engine: its decode leg waits there only for the prefill queued
        # ahead of it (whether it is split is the disaggregation choice, made among
        # these engines)
        def uncached(engine_id: str) -> int:
            return 0 if prefill else self.uncached(by_id[engine_id], need.sched, now)

        admitted = self.gate.admit(
            model, need.priority, self.ttft_budget_s(need, now),
            [ReadyEngine(e.id, engine_load(e)) for e in ready], [e.id for e in engines],
            uncached)
        chosen = {e.id: e for e in engines}
        return [chosen[i] for i in admitted]

    def place(self, need: Need, exclude: frozenset[str] = frozenset()) -> Placement | None:
        """Pick an engine with room for ``need`` (and, with adaptive admission, within
        its SLO) and lease it, or None when none has room now.

        Raises:
            Rejected: ``predicted_miss``, as :meth:`within_slo`.
        """
        sched = need.sched
        candidates = self.candidates(sched.model, need.priority, need.tokens, exclude)
        now = self.clock.now()
        split = sched.model in self.split_models and need.splittable and not exclude
        prefill = self.candidates(sched.model, need.priority, sched.prompt_tokens,
                                  prefill=True) if split and candidates else []
        if candidates and self.adaptive.enabled and need.arrived is not None:
            candidates = self.within_slo(candidates, need, now, prefill)
        if not candidates:
            return None
        if split:
            return self._place_split(need, candidates, prefill, now)
        decision = self.scheduler.pick(need.sched, candidates, now)
        if decision is None:
            return None
        engine = decision.engine
        uncached = self.uncached(engine, need.sched, now)  # before record() adds the blocks
        blocks = kv_blocks(need.tokens, engine.block_size)
        lease = self.pool.lease(engine, blocks)
        self.scheduler.record(need.sched, engine, now)
        placement = Placement(lease, decision.scores, uncached=uncached,
                              prefix_tokens=decision.prefix_tokens, need=need)
        self._open_flight(placement, uncached, need)
        return placement

    def _open_flight(self, placement: Placement, uncached: int, need: Need) -> None:
        """``need`` goes to ``placement``'s engine computing ``uncached`` prompt tokens
        there: its flight in the gate's ledger of the engine
        (:meth:`limits.slo_gate.SloGate.open_flight`), closed on release; nothing
        without a ledger."""
        engine = placement.engine
        flight = self.gate.open_flight(engine.id, engine.model, uncached,
                                       need.sched.prompt_tokens, need.priority,
                                       need.output_tokens, need.streamed)
        if flight is not None:
            placement.flight, placement.gate = flight, self.gate
            placement.on_release = self._close_flight

    def _close_flight(self, placement: Placement) -> None:
        """A placement's release: :meth:`limits.slo_gate.SloGate.close_flight`."""
        assert placement.flight is not None
        self.gate.close_flight(placement.engine.id, placement.engine.model, placement.flight)

    def _place_split(self, need: Need, candidates: list[Engine], prefill: Sequence[Engine],
                     now: float) -> Placement | None:
        """The disaggregation choice among ``candidates`` (decode side) and ``prefill``
        (the prefill engines with room for the prompt); leases what it chose."""
        assert self.disagg is not None
        sched = need.sched
        cached = ({e.id: self.scheduler.index.match(e, sched.blocks, now) * sched.block_size
                   for e in (*candidates, *prefill)} if sched.blocks and sched.block_size else {})
        budget = self.ttft_budget_s(need, now)
        choice = self.disagg.choose(sched.prompt_tokens, cached, candidates, prefill)
        if choice is None:
            return None
        sheddable = self.gate.sheddable(need.priority, choice.observed, choice.alone_s)
        if sheddable:  # predicted to start after its TTFT budget: shed (predicted_miss)
            self.gate.check_start(sched.model, need.priority, budget, choice.ttft_s)
        lease = self.pool.lease(choice.decode, kv_blocks(need.tokens, choice.decode.block_size))
        self.scheduler.record(sched, choice.decode, now)
        scores = {"pd_split": float(choice.prefill is not None),
                  "pd_predicted_ttft_ms": choice.ttft_s * 1000}
        placement = Placement(lease, scores, uncached=choice.uncached,
                              start_by=now + budget - choice.alone_s, sheddable=sheddable,
                              hold_local=choice.prefill is None and self.disagg.holds_local,
                              need=need)
        if choice.prefill is not None:
            placement.prefill = self._lease_prefill(need, choice.prefill, now)
        # the decode engine's ledger holds it; a leg computes nothing there (KV loaded)
        self._open_flight(placement, choice.uncached if choice.prefill is None else 0, need)
        return placement

    def _lease_prefill(self, need: Need, engine: Engine, now: float) -> EngineLease:
        lease = self.pool.lease(engine, kv_blocks(need.sched.prompt_tokens, engine.block_size))
        self.scheduler.record(need.sched, engine, now)  # its prefix cache will hold the prompt
        return lease

    def prefill_attempts(self, placement: Placement, need: Need,
                         max_attempts: int) -> Iterator[EngineLease]:
        """``placement.prefill``, then — each time the caller asks for another (its
        prefill leg failed) — a lease on a prefill engine not tried yet with the
        shortest predicted prefill queue, up to ``max_attempts`` in all; ends when
        none has room. The caller releases each lease it receives (``with``)."""
        assert self.disagg is not None
        tried: set[str] = set()
        lease = placement.prefill
        while lease is not None:
            tried.add(lease.engine.id)
            yield lease
            if len(tried) >= max_attempts:
                return
            others = self.candidates(need.sched.model, need.priority, need.sched.prompt_tokens,
                                     frozenset(tried), prefill=True)
            if not others:
                return
            best = min(others, key=lambda e: self.disagg.queue.wait_s(e, placement.uncached))
            lease = placement.prefill = self._lease_prefill(need, best, self.clock.now())

    async def hold_local_prefill(self, placement: Placement) -> Callable[[], None] | None:
        """For a whole request the split choice placed on a decode engine, where the
        policy holds local prefills (``placement.hold_local``,
        :attr:`gateway.disagg.Disaggregator.holds_local`): wait until its prompt fits
        the engine's step budget (:class:`gateway.prefill_queue.PrefillQueue`) and
        return the callback for :meth:`prefill_tracking`; None where nothing is held
        (a retry or a multi-sequence request goes at once).

        Raises:
            LegShed: it was held past its latest start and shed.
            asyncio.CancelledError: the caller was cancelled (it leaves the queue).
        """
        if self.disagg is None or not placement.hold_local:
            return None
        return await self.disagg.queue.admit(placement.engine, placement.uncached,
                                             placement.start_by, placement.sheddable)

    @asynccontextmanager
    async def local_prefill(self, placement: Placement, tracked: bool,
                            spans: Spans) -> AsyncIterator[Callable[[], None] | None]:
        """A ``tracked`` whole request's prefill on ``placement``'s engine: held
        first where the policy holds local prefills (:meth:`hold_local_prefill`, in a
        ``queue.prefill`` span), then counted while the request runs
        (:meth:`prefill_tracking`, whose first-token callback it yields).

        Raises:
            LegShed: as :meth:`hold_local_prefill`.
        """
        held = None
        if tracked:
            with spans("queue.prefill"):
                held = await self.hold_local_prefill(placement)
        with self.prefill_tracking(placement, tracked, held) as first_token:
            yield first_token

    @contextmanager
    def prefill_tracking(self, placement: Placement, tracked: bool,
                         held: Callable[[], None] | None = None,
                         ) -> Iterator[Callable[[], None] | None]:
        """While a ``tracked`` whole request runs on ``placement``'s engine, count its
        uncached prompt as queued prefill there (the split choice's prediction);
        yields the first-token callback, or None when not tracked. ``held``: the
        callback :meth:`hold_local_prefill` returned; its place in the queue is freed
        once the prompt counts as outstanding, and the queue is released at the first
        token and at the end."""
        if not tracked or self.disagg is None:
            yield None
            return
        engine, queue = placement.engine, self.disagg.queue
        try:
            with self.disagg.speed.track(engine, placement.uncached) as first_token:
                if held is None:
                    yield first_token
                    return
                held()

                def computed() -> None:
                    first_token()
                    queue.release(engine)
                yield computed
        finally:
            if held is not None:
                queue.release(engine)

    def attempts(self, first: Placement, need: Need, max_attempts: int) -> Iterator[Placement]:
        """``first``, then — each time the caller asks for another (its attempt failed
        before the first byte) — a new placement on an engine not tried yet, up to
        ``max_attempts`` in all; ends when none has room. The caller releases each
        placement it receives (``async with``)."""
        tried: set[str] = set()
        placement: Placement | None = first
        while placement is not None:
            tried.add(placement.engine.id)
            yield placement
            if len(tried) >= max_attempts:
                return
            placement = self.place(need, frozenset(tried))
