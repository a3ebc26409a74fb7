"""The SLO gate: the one owner of adaptive admission's state (docs/adaptive-admission.md).

It holds each engine's latency ledger (:class:`~limits.engine_latency.EngineLatency`)
keyed by engine id and each model's :class:`~limits.band_demand.BandDemand`, decides
whether engines may take a request within its band's SLO (:meth:`SloGate.admit`,
raising ``predicted_miss`` sheds), opens and closes the requests' flights, takes the
engines' scraped counters, and offers a read-only view (mode, learned limit, fitted
parameters, queued prefill, TTFT̂) for the metrics, the stats feed, the capacity
report and the scheduler's scorers (:class:`limits.interfaces.SloView`).

Engines arrive as ids and :class:`~limits.interfaces.ReadyEngine` records: this module
imports nothing from ``engines`` or ``gateway``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from config.schema import PRIORITIES, AdaptiveConfig, Priority, SloConfig
from limits.band_demand import BandDemand
from limits.decision import best_effort_wait_s
from limits.engine_latency import EngineLatency, Flight
from limits.gradient import GradientLimiter
from limits.interfaces import Clock, EngineCounters, ReadyEngine
from limits.latency_model import LatencyModel
from limits.outcome import Outcome, Rejected


class SloGate:
    """Per-engine ledgers and per-model band demand, and the decisions on them.

    Args:
        slo: the per-band TTFT/TPOT targets.
        adaptive: the adaptive admission's settings; when disabled no engine gets a
            ledger and :meth:`admit` is not consulted.
        clock: monotonic time, s.
        retry_after: model → ``Retry-After`` s for a ``predicted_miss`` shed.
    """

    def __init__(self, *, slo: SloConfig | None = None, adaptive: AdaptiveConfig | None = None,
                 clock: Clock, retry_after: Callable[[str], int] = lambda m: 1) -> None:
        self.slo = slo or SloConfig()
        self.adaptive = adaptive or AdaptiveConfig(enabled=False)
        self.clock = clock
        self.retry_after = retry_after
        #: engine id → its latency ledger (with adaptive admission)
        self.ledgers: dict[str, EngineLatency] = {}
        #: per model, each band's expected occupancy (room kept for urgent bands)
        self.demand: dict[str, BandDemand] = {}

    @property
    def enabled(self) -> bool:
        return self.adaptive.enabled

    # ------------------------------------------------------------------ engines

    def track(self, engine_id: str, unmetered_limit: int | None = None) -> None:
        """Give an engine its latency ledger (with adaptive admission).
        ``unmetered_limit``: for an engine whose dialect reports no KV-cache usage,
        the fixed in-flight cap it would have without adaptive admission
        (``saturation.unmetered_max_in_flight``): its learned limit is all that admits
        it, so its fallback limiter starts there; None for the default limiter."""
        if self.adaptive.enabled:
            gradient = None if unmetered_limit is None else GradientLimiter(initial=unmetered_limit)
            self.ledgers[engine_id] = EngineLatency(
                LatencyModel(forgetting=self.adaptive.forgetting,
                             min_samples=self.adaptive.min_samples,
                             max_rel_error=self.adaptive.max_rel_error),
                self.clock, z=self.adaptive.confidence_z, gradient=gradient, name=engine_id)

    def forget(self, engine_id: str) -> None:
        """An engine left the pool: its ledger goes."""
        self.ledgers.pop(engine_id, None)

    def drop_model(self, model: str) -> None:
        """A model is no longer served: its band demand goes."""
        self.demand.pop(model, None)

    def ledger(self, engine_id: str) -> EngineLatency | None:
        """``engine_id``'s ledger, or None (adaptive admission off, or not tracked)."""
        return self.ledgers.get(engine_id)

    def scraped(self, engine_id: str, counters: EngineCounters) -> None:
        """An engine's histograms and counters were read
        (:meth:`~limits.engine_latency.EngineLatency.scraped`)."""
        ledger = self.ledgers.get(engine_id)
        if ledger is not None:
            ledger.scraped(counters)

    # ------------------------------------------------------------------ demand

    def band_demand(self, model: str) -> BandDemand:
        """``model``'s per-band demand (created on first use)."""
        demand = self.demand.get(model)
        if demand is None:
            demand = self.demand[model] = BandDemand(self.clock, PRIORITIES)
        return demand

    def arrived(self, model: str, priority: Priority) -> None:
        """A request of ``priority`` for ``model`` arrived (its band's arrival rate)."""
        self.band_demand(model).arrived(priority)

    # ------------------------------------------------------------------ decisions

    def ttft_budget_s(self, priority: Priority, arrived: float | None, now: float) -> float:
        """Time left at clock time ``now`` before the TTFT target of a request of
        ``priority`` that arrived at ``arrived``, s: its band's target less the time
        since it arrived (infinite when it has no arrival time)."""
        if arrived is None:
            return math.inf
        return self.slo.target(priority).ttft_s - (now - arrived)

    def admit(self, model: str, priority: Priority, budget_s: float,
              ready: Sequence[ReadyEngine], candidates: Sequence[str],
              uncached: Callable[[str], int]) -> list[str]:
        """The engines among ``candidates`` (ids of ready engines with room) predicted
        to serve a request of ``priority`` for ``model`` within its band's SLO
        (:func:`limits.decision.decide`), keeping room for more urgent bands;
        bursts pass while the long-run occupancy (all bands), shared among the
        ``ready`` engines in proportion to their knees, is under each engine's knee.
        Engines that can meet the request's SLO are preferred: those that take it only
        at best effort (:meth:`~limits.engine_latency.EngineLatency.best_effort`: too
        slow for its TPOT target even alone) are returned only when none of the
        others would. A request of the least urgent band (``batch``) goes only where
        it leaves the next urgent request its start (:meth:`_urgent_ttft_s`).
        Order follows ``candidates``.

        Args:
            budget_s: the request's TTFT budget now, s (:meth:`ttft_budget_s`).
            ready: every ready engine serving whole requests of ``model``, with its
                reported load.
            uncached: engine id → the request's prompt tokens that engine would
                compute (0 for all when a prefill engine may take the prompt).

        Raises:
            Rejected: ``OVERLOADED`` (reason ``predicted_miss``) when, with every
                ready engine's TTFT fit trusted (``LatencyModel.ttft_trusted``: the
                prediction read here; its TPOT model need not be), even one with no
                prefill queued would start the request after its TTFT target because
                of the time it has already waited (it could have met it on arrival):
                serving it late would only take capacity from requests that can still
                make theirs. Issue 44: gated on the TPOT model's trust, one engine
                whose TPOT fit stayed untrusted under load turned this off for the
                whole fleet, and late requests stayed queued in front of engines
                below their knees.
                Engines at best effort for the request do not count; one of them with
                room takes the request instead (a late start there costs no one's
                SLO).
        """
        target = self.slo.target(priority)
        z = self.adaptive.confidence_z
        ledgers = self.ledgers
        best = math.inf  # the soonest start on an engine that can meet the SLO
        for r in ready:
            lat = ledgers.get(r.id)
            if lat is None or not lat.model.ttft_trusted:
                best = -math.inf  # not known: no shedding
                break
            if not lat.best_effort(target.tpot_s):
                best = min(best, lat.model.predict_ttft(uncached(r.id), lat.decoding).upper(z))
        demand = self.band_demand(model)
        # the knees and free places of the engines with a learned limit for this band
        loads = {r.id: r.load for r in ready}
        knees: dict[str, int] = {}
        free: dict[str, int] = {}
        for r in ready:
            lat = ledgers.get(r.id)
            if lat is not None and (k := lat.limit(target.tpot_s)) is not None:
                knees[r.id] = k
                free[r.id] = max(0, k - lat.occupied(loads[r.id]))
        places = sum(knees.values())
        ttft_targets = {b: self.slo.target(b).ttft_s for b in PRIORITIES}
        keep = demand.urgent_free(priority, places, ttft_targets)
        total_free = sum(free.values())
        # the long-run occupancy of this band and the more urgent ones (the others
        # yield to them), shared among the engines as their knees are
        per_knee = demand.occupancy_through(priority) / max(1, places)
        # whether an engine not at best effort for the band may take it (else a
        # best-effort engine takes it by its capacity signals alone)
        elsewhere = any((lat := ledgers.get(r.id)) is None or not lat.best_effort(target.tpot_s)
                        for r in ready)
        # a request of the least urgent band leaves the next urgent one its start
        after_s = self._urgent_ttft_s(model, priority)
        within, best_effort = [], []
        for e in candidates:
            tokens = uncached(e)
            if after_s is not None and self.starts_after_one(e, tokens, after_s) is False:
                continue
            lat = ledgers.get(e)
            if lat is None:
                within.append(e)
                continue
            verdict = lat.decide(
                tokens, budget_s, target.tpot_s,
                loads.get(e, 0),
                max(0, keep - (total_free - free.get(e, 0))),
                per_knee * knees.get(e, 0), elsewhere, ttft_target_s=target.ttft_s)
            if verdict.admit:
                (best_effort if verdict.best_effort else within).append(e)
        if budget_s < best <= target.ttft_s:
            if best_effort:
                return best_effort
            raise Rejected(Outcome.OVERLOADED,
                           f"no engine can start this {priority} request within its "
                           f"{target.ttft_s:g} s TTFT target any more; shed",
                           retry_after_s=self.retry_after(model), reason="predicted_miss")
        return within or best_effort

    def _urgent_ttft_s(self, model: str, priority: Priority) -> float | None:
        """For a request of the least urgent band (offline work, which fills spare
        capacity only), once a more urgent band has arrivals: the tightest TTFT target
        of those bands, s — an engine takes the request only while one of them sent
        right after it would still start within it (:meth:`starts_after_one`; on an
        FCFS engine this request's prefill runs first). None otherwise."""
        if priority != PRIORITIES[-1]:
            return None
        urgent = PRIORITIES[:-1]
        if not sum(self.band_demand(model).rates(urgent).values()):
            return None
        return min(self.slo.target(b).ttft_s for b in urgent)

    def starts_after_one(self, engine_id: str, uncached_tokens: int, ttft_s: float) -> bool | None:
        """Whether a request of ``uncached_tokens`` sent to ``engine_id`` right after
        another as long is predicted (``TTFT̂ + z σ``, the prefills pending there, the
        other's and its own) to start within ``ttft_s`` (s). While the engine's TTFT
        fit is not trusted (a gateway just started, an engine just added): whether no
        prefill is pending there, so the other's is the only one the request may wait
        behind (else a batch's first lines, sent together to engines not yet learned,
        queue their prefills ahead of the first online requests: issue 43). None
        without a ledger."""
        lat = self.ledgers.get(engine_id)
        if lat is None:
            return None
        if not lat.model.ttft_trusted:
            return lat.pending_prefill_tokens == 0
        return lat.predict_ttft(2 * uncached_tokens).upper(lat.z) <= ttft_s

    def best_effort_wait_s(self, model: str, priority: Priority, max_wait_s: float,
                           ready: Sequence[str]) -> float | None:
        """The longest a ``priority`` request of ``model`` whose queue deadline is
        ``max_wait_s`` (s) away should wait in the queue when every ``ready`` engine
        (ids of the ready engines serving whole requests of ``model``) serves its band
        at best effort (:meth:`~limits.engine_latency.EngineLatency.best_effort`):
        that deadline less the band's mean time on an engine
        (:func:`~limits.decision.best_effort_wait_s`), so what is admitted is
        answered by it and the queue refuses at once, with ``Retry-After``, what it
        predicts would wait longer. None otherwise, or before a request of the band
        has been timed."""
        if not self.adaptive.enabled:
            return None
        tpot_s = self.slo.target(priority).tpot_s
        if not ready or any((lat := self.ledgers.get(e)) is None or not lat.best_effort(tpot_s)
                            for e in ready):
            return None
        return best_effort_wait_s(max_wait_s, self.band_demand(model).service_s(priority))

    def sheddable(self, priority: Priority, observed: bool, alone_s: float) -> bool:
        """Whether a split model's request is shed once predicted to start after its
        TTFT budget (at placement, and for its prefill leg while held at the gateway),
        as :meth:`admit` sheds a whole request: served late, it would only delay the
        prefills queued behind it, which can still make their targets. Only with
        adaptive admission, where the estimate is the gateway's own observation
        (``observed``), and where the request could have met its target with no
        prefill queued ahead (``alone_s``, s: a prompt too long for the target even
        alone is served at best effort)."""
        return (self.adaptive.enabled and observed
                and alone_s <= self.slo.target(priority).ttft_s)

    def check_start(self, model: str, priority: Priority, budget_s: float,
                    predicted_s: float) -> None:
        """A sheddable split request (:meth:`sheddable`) predicted to start in
        ``predicted_s`` (s) with ``budget_s`` (s) left before its TTFT target.

        Raises:
            Rejected: ``OVERLOADED``, reason ``predicted_miss``, when it would start
                after its budget.
        """
        if budget_s < predicted_s:
            target = self.slo.target(priority)
            raise Rejected(Outcome.OVERLOADED,
                           f"this {priority} request would start after its "
                           f"{target.ttft_s:g} s TTFT target (predicted "
                           f"{predicted_s:.2f} s); shed",
                           retry_after_s=self.retry_after(model), reason="predicted_miss")

    def prefill_shed(self, model: str, priority: Priority) -> Rejected:
        """The error of a request whose prefill was held at the gateway past its
        latest start (``gateway.prefill_queue.LegShed``)."""
        target = self.slo.target(priority).ttft_s
        return Rejected(Outcome.OVERLOADED,
                        f"this {priority} request's prefill could not start "
                        f"within its {target:g} s TTFT target any more; shed",
                        retry_after_s=self.retry_after(model), reason="predicted_miss")

    # ------------------------------------------------------------------ flights

    def open_flight(self, engine_id: str, model: str, uncached: int, prompt_tokens: int,
                    priority: Priority, output_tokens: int,
                    streamed: bool = True) -> Flight | None:
        """A request goes to ``engine_id`` computing ``uncached`` prompt tokens there:
        its flight in the engine's ledger (None without one), whose predicted time on
        the engine feeds the band's demand. ``streamed`` False: the engine's answer
        comes whole (:meth:`limits.engine_latency.EngineLatency.sent`)."""
        ledger = self.ledgers.get(engine_id)
        if ledger is None:
            return None
        flight = ledger.sent(uncached, prompt_tokens, self.slo.target(priority).tpot_s,
                             PRIORITIES.index(priority), output_tokens, streamed)
        self.band_demand(model).started(priority, flight.expected_s)
        return flight

    def first_token(self, engine_id: str, flight: Flight) -> None:
        """``flight`` streamed its first token now."""
        ledger = self.ledgers.get(engine_id)
        if ledger is not None:
            ledger.first_token(flight)

    def finished(self, engine_id: str, flight: Flight, **usage: object) -> None:
        """``flight`` ended now (:meth:`~limits.engine_latency.EngineLatency.finished`,
        whose keyword arguments ``usage`` carries)."""
        ledger = self.ledgers.get(engine_id)
        if ledger is not None:
            ledger.finished(flight, **usage)  # type: ignore[arg-type]

    def close_flight(self, engine_id: str, model: str, flight: Flight) -> None:
        """A placement's release: its flight leaves the ledger (learning nothing if
        the caller did not finish it) and its time on the engine feeds the band's
        demand."""
        ledger = self.ledgers.get(engine_id)
        if ledger is not None:
            ledger.finished(flight, ok=False)  # no-op if already finished
        self.band_demand(model).served(
            PRIORITIES[flight.band], self.clock.now() - flight.sent_at,
            None if flight.first_at is None else flight.first_at - flight.sent_at,
            flight.expected_s)

    # ------------------------------------------------------------------ read-only view

    def tracks(self, engine_id: str) -> bool:
        return engine_id in self.ledgers

    def model(self, engine_id: str) -> LatencyModel | None:
        ledger = self.ledgers.get(engine_id)
        return None if ledger is None else ledger.model

    def mode(self, engine_id: str, tpot_target_s: float) -> str | None:
        """:meth:`~limits.engine_latency.EngineLatency.mode`, None without a ledger."""
        ledger = self.ledgers.get(engine_id)
        return None if ledger is None else ledger.mode(tpot_target_s)

    def limit(self, engine_id: str, tpot_target_s: float) -> int | None:
        """:meth:`~limits.engine_latency.EngineLatency.limit`, None without a ledger."""
        ledger = self.ledgers.get(engine_id)
        return None if ledger is None else ledger.limit(tpot_target_s)

    def decoding(self, engine_id: str) -> int:
        """Requests on the engine past their first token (0 without a ledger)."""
        ledger = self.ledgers.get(engine_id)
        return 0 if ledger is None else ledger.decoding

    def pending_prefill_tokens(self, engine_id: str) -> int:
        """Uncached prompt tokens of requests on the engine before their first token
        (0 without a ledger)."""
        ledger = self.ledgers.get(engine_id)
        return 0 if ledger is None else ledger.pending_prefill_tokens

    def predicted_ttft_s(self, engine_id: str, uncached_tokens: int) -> float | None:
        """Mean TTFT̂ of a request of ``uncached_tokens`` sent now, s (None without a
        ledger)."""
        ledger = self.ledgers.get(engine_id)
        return None if ledger is None else ledger.predict_ttft(uncached_tokens).mean
