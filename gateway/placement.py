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
predicted to serve the request within its band's SLO (:mod:`limits.engine_latency`) —
for an engine that reports no KV-cache usage this learned limit is the whole
admission (``limits.saturation`` then caps it only at the engine's slots) —
and each placement holds a :class:`~limits.engine_latency.Flight` in the engine's
latency ledger, which the caller feeds (first token, usage, end) and the release
closes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from config.schema import PRIORITIES, AdaptiveConfig, Priority, SloConfig
from engines.kinds import KINDS
from engines.plugins import engine_load
from engines.pool import Engine, EngineLease, EnginePool
from engines.scheduler import SchedRequest, Scheduler
from gateway.disagg import Choice, Disaggregator, role, serves_whole
from limits.band_demand import BandDemand
from limits.engine_latency import EngineLatency, Flight
from limits.gradient import GradientLimiter
from limits.interfaces import Clock
from limits.latency_model import LatencyModel
from limits.outcome import Outcome, Rejected
from limits.saturation import SaturationDetector, kv_blocks


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
    ``uncached`` is the prompt tokens the first engine is predicted to compute. With
    adaptive admission, ``flight`` is the request's entry in the engine's latency
    ledger and ``on_release`` closes it (once, on the first :meth:`release`).
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

    @property
    def engine(self) -> Engine:
        return self.lease.engine

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
    """

    sched: SchedRequest
    priority: Priority
    tokens: int
    splittable: bool = True
    arrived: float | None = None
    output_tokens: int = 0


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
            pool gets an :class:`~limits.engine_latency.EngineLatency`.
        retry_after: model → ``Retry-After`` s for a ``predicted_miss`` shed.
    """

    def __init__(self, *, pool: EnginePool, scheduler: Scheduler,
                 detector: SaturationDetector, clock: Clock,
                 disagg: Disaggregator | None = None,
                 split_models: frozenset[str] = frozenset(),
                 slo: SloConfig | None = None, adaptive: AdaptiveConfig | None = None,
                 retry_after: Callable[[str], int] = lambda m: 1) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.detector = detector
        self.clock = clock
        self.disagg = disagg
        self.split_models = split_models if disagg is not None else frozenset()
        self.slo = slo or SloConfig()
        self.adaptive = adaptive or AdaptiveConfig(enabled=False)
        self.retry_after = retry_after
        #: per model, each band's expected occupancy (room kept for urgent bands)
        self.demand: dict[str, BandDemand] = {}
        for e in pool.engines:
            self.track(e)

    def track(self, engine: Engine) -> None:
        """Give an engine of the pool its latency ledger (with adaptive admission)."""
        if self.adaptive.enabled:
            engine.latency = EngineLatency(
                LatencyModel(forgetting=self.adaptive.forgetting,
                             min_samples=self.adaptive.min_samples,
                             max_rel_error=self.adaptive.max_rel_error),
                self.clock, z=self.adaptive.confidence_z, gradient=self._gradient(engine),
                name=engine.id)

    def _gradient(self, engine: Engine) -> GradientLimiter | None:
        """The fallback limiter of an engine whose dialect reports no KV-cache usage
        (llama.cpp, TGI, a bare OpenAI server): its learned limit is all that admits
        it, so it starts at ``saturation.unmetered_max_in_flight``, the fixed cap it
        would have without adaptive admission. None (the default limiter) for
        others."""
        kind = KINDS.get(engine.labels.get("dialect", "vllm"))
        if kind is None or "kv_usage" in kind.signals:
            return None
        return GradientLimiter(initial=self.detector.unmetered_max_in_flight)

    def forget(self, engine: Engine) -> None:
        """An engine left the pool: drop its prefill-speed estimate (its latency
        ledger leaves with it)."""
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

    def band_demand(self, model: str) -> BandDemand:
        """``model``'s per-band demand (created on first use)."""
        demand = self.demand.get(model)
        if demand is None:
            demand = self.demand[model] = BandDemand(self.clock, PRIORITIES)
        return demand

    def uncached(self, engine: Engine, sched: SchedRequest, now: float) -> int:
        """Prompt tokens ``engine`` must compute for ``sched``: the prompt less the
        leading blocks its prefix index says the engine holds."""
        hit = self.scheduler.index.match(engine, sched.blocks, now) if sched.blocks else 0
        return max(0, sched.prompt_tokens - hit * sched.block_size)

    def ttft_budget_s(self, need: Need, now: float) -> float:
        """Time left at clock time ``now`` before ``need``'s TTFT target, s: its band's
        target less the time since it arrived (infinite when it has no arrival time)."""
        if need.arrived is None:
            return math.inf
        return self.slo.target(need.priority).ttft_s - (now - need.arrived)

    def within_slo(self, engines: list[Engine], need: Need, now: float,
                   prefill: Sequence[Engine] = ()) -> list[Engine]:
        """The engines among ``engines`` (candidates of :meth:`candidates`, so ready
        ones) predicted to serve ``need`` within its band's SLO
        (:func:`limits.engine_latency.decide`), keeping room for more urgent bands;
        bursts pass while the long-run occupancy (all bands), shared among the ready
        engines in proportion to their knees, is under each engine's knee. Engines
        that can meet the request's SLO are preferred: those that take it only at best
        effort (:meth:`~limits.engine_latency.EngineLatency.best_effort`: too slow for
        its TPOT target even alone) are returned only when none of the others would.
        ``prefill``: the prefill engines with room for a request that may be split
        (then no engine here computes its prompt; empty otherwise).

        Raises:
            Rejected: ``OVERLOADED`` (reason ``predicted_miss``) when, with every
                ready engine's model trusted, even one with no prefill queued would
                start the request after its TTFT target because of the time it has
                already waited (it could have met it on arrival): serving it late
                would only take capacity from requests that can still make theirs.
                Engines at best effort for the request do not count; one of them with
                room takes the request instead (a late start there costs no one's
                SLO).
        """
        assert need.arrived is not None
        model, priority = need.sched.model, need.priority
        target = self.slo.target(priority)
        budget = self.ttft_budget_s(need, now)
        z = self.adaptive.confidence_z
        ready = [e for e in self.pool.for_model(model) if e.routable and serves_whole(e)]
        # a request one of the ``prefill`` engines can take computes none of its prompt
        # on the decode engine: its decode leg waits there only for the prefill queued
        # ahead of it (whether it is split is the disaggregation choice, made among
        # these engines)
        def uncached(e: Engine) -> int:
            return 0 if prefill else self.uncached(e, need.sched, now)

        best = math.inf  # the soonest start on an engine that can meet the SLO
        for e in ready:
            lat = e.latency
            if lat is None or not lat.model.confident:
                best = -math.inf  # not known: no shedding
                break
            if not lat.best_effort(target.tpot_s):
                best = min(best, lat.model.predict_ttft(uncached(e), lat.decoding).upper(z))
        demand = self.band_demand(model)
        # the knees and free places of the engines with a learned limit for this band
        loads = {e.id: engine_load(e) for e in ready}
        knees: dict[str, int] = {}
        free: dict[str, int] = {}
        for e in ready:
            if e.latency is not None and (k := e.latency.limit(target.tpot_s)) is not None:
                knees[e.id] = k
                free[e.id] = max(0, k - e.latency.occupied(loads[e.id]))
        places = sum(knees.values())
        ttft_targets = {b: self.slo.target(b).ttft_s for b in PRIORITIES}
        keep = demand.urgent_free(priority, places, ttft_targets)
        total_free = sum(free.values())
        # the long-run occupancy of this band and the more urgent ones (the others
        # yield to them), shared among the engines as their knees are
        per_knee = demand.occupancy_through(priority) / max(1, places)
        # whether an engine not at best effort for the band may take it (else a
        # best-effort engine takes it by its capacity signals alone)
        elsewhere = any(e.latency is None or not e.latency.best_effort(target.tpot_s)
                        for e in ready)
        within, best_effort = [], []
        for e in engines:
            if e.latency is None:
                within.append(e)
                continue
            verdict = e.latency.decide(
                uncached(e), budget, target.tpot_s,
                loads[e.id],
                max(0, keep - (total_free - free.get(e.id, 0))),
                per_knee * knees.get(e.id, 0), elsewhere)
            if verdict.admit:
                (best_effort if verdict.best_effort else within).append(e)
        if budget < best <= target.ttft_s:
            if best_effort:
                return best_effort
            raise Rejected(Outcome.OVERLOADED,
                           f"no engine can start this {priority} request within its "
                           f"{target.ttft_s:g} s TTFT target any more; shed",
                           retry_after_s=self.retry_after(model), reason="predicted_miss")
        return within or best_effort

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
        if engine.latency is None:
            return Placement(lease, decision.scores, uncached=uncached,
                             prefix_tokens=decision.prefix_tokens)
        return Placement(lease, decision.scores, uncached=uncached,
                         flight=self._open_flight(engine, uncached, need),
                         on_release=self._close_flight, prefix_tokens=decision.prefix_tokens)

    def _open_flight(self, engine: Engine, uncached: int, need: Need) -> Flight:
        """``need`` goes to ``engine`` computing ``uncached`` prompt tokens there: its
        flight in the engine's latency ledger, whose predicted time on the engine
        feeds the band's demand."""
        assert engine.latency is not None
        flight = engine.latency.sent(uncached, need.sched.prompt_tokens,
                                     self.slo.target(need.priority).tpot_s,
                                     PRIORITIES.index(need.priority), need.output_tokens)
        self.band_demand(engine.model).started(need.priority, flight.expected_s)
        return flight

    def _close_flight(self, placement: Placement) -> None:
        """A placement's release: its flight leaves the ledger (learning nothing if
        the caller did not finish it) and its time on the engine feeds the band's
        demand."""
        flight, engine = placement.flight, placement.engine
        assert flight is not None and engine.latency is not None
        engine.latency.finished(flight, ok=False)  # no-op if already finished
        self.band_demand(engine.model).served(
            PRIORITIES[flight.band], self.clock.now() - flight.sent_at,
            None if flight.first_at is None else flight.first_at - flight.sent_at,
            flight.expected_s)

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
        sheddable = self._sheddable(need, choice)
        if sheddable and budget < choice.ttft_s:
            self._shed(need, choice)
        lease = self.pool.lease(choice.decode, kv_blocks(need.tokens, choice.decode.block_size))
        self.scheduler.record(sched, choice.decode, now)
        scores = {"pd_split": float(choice.prefill is not None),
                  "pd_predicted_ttft_ms": choice.ttft_s * 1000}
        placement = Placement(lease, scores, uncached=choice.uncached,
                              start_by=now + budget - choice.alone_s, sheddable=sheddable,
                              hold_local=choice.prefill is None and self.disagg.holds_local)
        if choice.prefill is not None:
            placement.prefill = self._lease_prefill(need, choice.prefill, now)
        if choice.decode.latency is not None:  # the decode engine's ledger holds it
            local = choice.uncached if choice.prefill is None else 0  # a leg: KV loaded
            placement.flight = self._open_flight(choice.decode, local, need)
            placement.on_release = self._close_flight
        return placement

    def _sheddable(self, need: Need, choice: Choice) -> bool:
        """Whether a split model's request on ``choice`` is shed once predicted to
        start after its TTFT budget (its band's target less the time it already
        waited; at placement, and for its prefill leg while held at the gateway), as
        :meth:`within_slo` sheds a whole request: served late, it would only delay the
        prefills queued behind it, which can still make their targets. Only with
        adaptive admission, where the estimate is the gateway's own observation
        (:attr:`~gateway.disagg.Choice.observed`), and where the request could have met
        its target with no prefill queued ahead (a prompt too long for the target even
        alone is served at best effort)."""
        return (self.adaptive.enabled and choice.observed
                and choice.alone_s <= self.slo.target(need.priority).ttft_s)

    def _shed(self, need: Need, choice: Choice) -> None:
        """Shed a request whose chosen option (when it is late, none is in time and
        it is the soonest: :meth:`~gateway.disagg.Disaggregator.choose`) is predicted
        to start after its TTFT budget (:meth:`_sheddable`).

        Raises:
            Rejected: ``OVERLOADED``, reason ``predicted_miss``.
        """
        target = self.slo.target(need.priority)
        raise Rejected(Outcome.OVERLOADED,
                       f"this {need.priority} request would start after its "
                       f"{target.ttft_s:g} s TTFT target (predicted "
                       f"{choice.ttft_s:.2f} s); shed",
                       retry_after_s=self.retry_after(need.sched.model),
                       reason="predicted_miss")

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
