"""One engine's SLO ledger: the requests in flight there, its fitted
:class:`~limits.latency_model.LatencyModel` and fallback limiter, and whether it may
take one more request (the pure rule, :func:`limits.decision.decide`, is in
:mod:`limits.decision`). What a scrape interval says
(:func:`limits.intervals.interval_observations`) is in :mod:`limits.intervals`.

The rules (TTFT and TPOT admission, room for the more urgent bands, the knee as the
concurrency limit, best effort, the observations from the proxy and from the engine's
scraped counters, :func:`interval_observations`) and their sources are in
``docs/adaptive-admission.md``, "The decision" and "Observations".
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass

from limits.decision import Verdict, decide
from limits.gradient import GradientLimiter
from limits.interfaces import Clock, EngineCounters
from limits.intervals import IntervalObservations, interval_observations
from limits.latency_model import LatencyModel, Prediction

log = logging.getLogger(__name__)


#: Best effort for a TPOT target ends when TPOT̂(1) + z σ falls under this fraction of it
#: (hysteresis: a predicted TPOT within 10 % of the target is within its noise).
BEST_EFFORT_EXIT = 0.9

#: Time constant of the average of the engine's interval inter-token latencies that
#: the fallback limiter reads, s (:meth:`EngineLatency.scraped`): a few prefills long,
#: so the average reads the mean TPOT of the requests decoding through them rather
#: than each prefill's slow steps (:mod:`limits.gradient`, on noise read as congestion).
GRADIENT_ITL_TAU_S = 2.0

#: Time constant of the smoothed throughput knee, s (:meth:`EngineLatency.throughput_limit`).
KNEE_TAU_S = 10.0

@dataclass(eq=False)
class Flight:
    """One request on the engine (the ledger's handle).

    Attributes:
        uncached_tokens: prompt tokens estimated not to hit the prefix cache.
        prompt_tokens: prompt tokens (the tokenizer's count).
        band: index of its priority band (0 most urgent).
        tpot_target_s: its band's TPOT target, s.
        sent_at: clock time it was sent, s.
        ahead_tokens / decoding_at_send: TTFT features at send time.
        predicted_ttft_s: TTFT̂ at send time, s.
        expected_s: its time on the engine predicted at send, s (TTFT̂ + TPOT̂ × its
            output tokens less one; 0 when its output tokens are not known).
        first_at: clock time of its first token, s (None before).
        integral_at_first / prefilled_at_first: ledger counters at ``first_at``.
        first_due: for an answer that does not stream (its first token is seen only
            with the whole answer), the clock time from which the ledger takes its
            prefill as done: sent + ``TTFT̂ + z σ`` at send, s; None for a stream.
    """

    uncached_tokens: int
    prompt_tokens: int
    band: int
    tpot_target_s: float
    sent_at: float
    ahead_tokens: int
    decoding_at_send: int
    predicted_ttft_s: float
    expected_s: float = 0.0
    first_at: float | None = None
    integral_at_first: float = 0.0
    prefilled_at_first: float = 0.0
    first_due: float | None = None


class EngineLatency:
    """One engine's ledger, model and fallback limiter.

    Args:
        model: the engine's latency model.
        clock: monotonic time, s.
        z: conservatism of decisions, standard deviations (default 1).
        gradient: the fallback limiter (default :class:`GradientLimiter` ()).
        name: the engine's id, for the log line on entering and leaving best effort.
    """

    def __init__(self, model: LatencyModel, clock: Clock, *, z: float = 1.0,
                 gradient: GradientLimiter | None = None, name: str = "") -> None:
        self.name = name
        self.model = model
        self.clock = clock
        self.z = z
        self.gradient = gradient or GradientLimiter()
        self.flights: set[Flight] = set()
        #: TPOT target (s) -> flights of it (:meth:`tightest_tpot_s` reads the keys
        #: without a pass over every flight)
        self._targets: Counter[float] = Counter()
        self._pending = 0  # :attr:`pending_prefill_tokens`
        self._decoding = 0  # :attr:`decoding`
        #: (first_due, tie-break, flight) of answers that do not stream (:meth:`_promote`)
        self._due: list[tuple[float, int, Flight]] = []
        self._due_seq = itertools.count()
        self._integral = 0.0  # ∫ in-flight dt, request·s
        self._integral_at = clock.now()
        self._prefilled = 0.0  # uncached tokens of requests past their first token
        #: relative TTFT prediction errors |TTFT̂ − TTFT| / TTFT of finished requests
        #: not yet collected by :meth:`drain_errors`
        self.ttft_errors: list[float] = []
        self._counters: EngineCounters | None = None  # the previous scrape's
        self._engine_turnover = False  # the scrapes feed the turnover ratio
        #: clock time (s) until which a prefill the scrapes saw scheduled may still
        #: run (:meth:`scraped`)
        self._prefill_until = -math.inf
        self._best_effort: set[float] = set()  # TPOT targets served at best effort, s
        #: the scrapes' inter-token latency averaged over GRADIENT_ITL_TAU_S, s
        self._itl: float | None = None
        #: the throughput knee, smoothed over :data:`KNEE_TAU_S` (:meth:`throughput_limit`)
        self._knee: float | None = None
        self._knee_at = -math.inf

    @property
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens of the requests here not past their first token (an
        answer that does not stream counts until its :attr:`Flight.first_due`)."""
        self._promote()
        return self._pending

    @pending_prefill_tokens.setter
    def pending_prefill_tokens(self, tokens: int) -> None:
        self._promote()
        self._pending = tokens

    @property
    def decoding(self) -> int:
        """Requests here past their first token (an answer that does not stream from
        its :attr:`Flight.first_due`)."""
        self._promote()
        return self._decoding

    def _promote(self) -> None:
        """Take the first token of each answer that does not stream as seen once its
        ``first_due`` has passed. Its real first token is seen only with the whole
        answer, so without this its prefill would count as pending, and it not as
        decoding, for its whole time on the engine: a batch of non-streaming lines
        then read as seconds of prefill queued ahead of every online request there
        (docs/adaptive-admission.md, "Observations")."""
        if not self._due:
            return
        now = self.clock.now()
        while self._due and self._due[0][0] <= now:
            _, _, flight = heapq.heappop(self._due)
            self.first_token(flight)

    def best_effort(self, tpot_target_s: float) -> bool:
        """Whether requests of TPOT target ``tpot_target_s`` (s) are served at best
        effort here: the model is trusted and ``TPOT̂(1) + z σ`` (one request alone, the
        knee's own test at a batch of 1) exceeds the target while the fit remembers a
        request decoding alone (:attr:`LatencyModel.alone_observed`: else TPOT̂(1) is
        an extrapolation, not evidence), or exceeded it and has not yet fallen under
        :data:`BEST_EFFORT_EXIT` × the target (docs/adaptive-admission.md, "Best effort")."""
        was = tpot_target_s in self._best_effort
        if not self.model.confident:  # an untrusted fit is no evidence to leave it
            return was
        alone = self.model.tpot_alone_s(self.z)
        now = (alone is not None and alone > tpot_target_s * (BEST_EFFORT_EXIT if was else 1.0)
               and (was or self.model.alone_observed))
        if now != was:
            if now:
                self._best_effort.add(tpot_target_s)
            else:
                self._best_effort.discard(tpot_target_s)
            log.info("engine %s: TPOT target %g ms %s best effort (TPOT^(1) + %g sd = %s)",
                     self.name, tpot_target_s * 1000, "served at" if now else "leaves",
                     self.z, "untrusted" if alone is None else f"{alone * 1000:.1f} ms")
        return now

    def mode(self, tpot_target_s: float) -> str:
        """The controller that admits requests of TPOT target ``tpot_target_s`` (s):
        ``best_effort`` (:meth:`best_effort`), ``model`` (the fitted model's rules) or
        ``gradient`` (the fallback limiter, while the model is not trusted)."""
        if self.best_effort(tpot_target_s):
            return "best_effort"
        return "model" if self.model.confident else "gradient"

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def tightest_tpot_s(self) -> float | None:
        """Smallest TPOT target among the requests in flight that are not served at
        best effort, s, or None."""
        return min((t for t in self._targets if not self.best_effort(t)), default=None)

    def limit(self, tpot_target_s: float) -> int | None:
        """The concurrency limit now for a request of TPOT target ``tpot_target_s``
        (s): the model's knee for the tightest of it and the running targets, the
        gradient limiter's, or at best effort the throughput knee
        (:meth:`LatencyModel.throughput_knee`: no batch meets the target, so the
        engine is held where its token rate stops growing and the rest wait in the
        gateway's queue, which refuses early what would wait past its deadline)."""
        mode = self.mode(tpot_target_s)
        if mode == "gradient":
            return max(1, math.floor(self.gradient.limit))
        if mode == "best_effort":
            return self.throughput_limit()
        target = min(tpot_target_s, self.tightest_tpot_s() or math.inf)
        return self.model.knee(target, self.z)

    def throughput_limit(self) -> int:
        """The concurrency limit at best effort: the model's throughput knee
        (:meth:`LatencyModel.throughput_knee`) smoothed over :data:`KNEE_TAU_S`
        (weight ``1 − e^(−Δt/τ)`` per reading, Δt the time since the last), and held
        while the fit is not trusted. Held at one batch size, the fit sees little
        spread of batches, so its fixed step time and per-sequence cost trade off
        from one scrape to the next and the knee, their ratio, swings (seen: 12 to
        68 within seconds on the simulated CPU engine); the smoothed knee follows a
        real change within tens of seconds. Requests, ≥ 1."""
        now = self.clock.now()
        if self.model.confident or self._knee is None:
            knee = self.model.throughput_knee()
            if self._knee is None:
                self._knee = float(knee)
            else:
                w = 1.0 - math.exp(-max(0.0, now - self._knee_at) / KNEE_TAU_S)
                self._knee += w * (knee - self._knee)
            self._knee_at = now
        return max(1, round(self._knee))

    def predict_ttft(self, uncached_tokens: int) -> Prediction:
        """TTFT̂ of a request of ``uncached_tokens`` sent now, s."""
        return self.model.predict_ttft(self.pending_prefill_tokens + uncached_tokens,
                                       self.decoding)

    def occupied(self, reported_load: int = 0) -> int:
        """Requests on the engine: the ledger's in-flight count, or ``reported_load``
        (this process's and other clients' requests in the engine's last report:
        :func:`engines.plugins.engine_load`) when larger."""
        return max(self.in_flight, reported_load)

    def decide(self, uncached_tokens: int, ttft_budget_s: float, tpot_target_s: float,
               reported_load: int = 0, reserve: float = 0.0,
               sustained: float | None = None, elsewhere: bool = True,
               ttft_target_s: float | None = None) -> Verdict:
        """:func:`limits.decision.decide` for this engine's state; ``reported_load`` (the requests on
        the engine, this process's and other clients' in its last report:
        :func:`engines.plugins.engine_load`) replaces the ledger's in-flight count
        when larger; ``reserve`` and
        ``sustained`` and ``elsewhere`` as there. At best effort (:meth:`best_effort`)
        rule 1 decides when ``elsewhere``, and the throughput knee caps the engine
        (``Verdict.best_effort`` when admitted)."""
        best_effort = self.best_effort(tpot_target_s)
        limit: float | None = None
        if best_effort:
            limit = self.throughput_limit()
        elif not self.model.confident:
            limit = self.gradient.limit
        return decide(self.model, uncached_tokens=uncached_tokens,
                      pending_prefill_tokens=self.pending_prefill_tokens,
                      decoding=self.decoding, in_flight=self.occupied(reported_load),
                      ttft_budget_s=ttft_budget_s, tpot_target_s=tpot_target_s,
                      tightest_running_tpot_s=self.tightest_tpot_s(), z=self.z,
                      limit=limit, reserve=reserve, sustained=sustained,
                      best_effort=best_effort, elsewhere=elsewhere,
                      ttft_target_s=ttft_target_s)

    # ------------------------------------------------------------------ the ledger

    def _advance(self, now: float) -> None:
        self._integral += len(self.flights) * max(0.0, now - self._integral_at)
        self._integral_at = now

    def sent(self, uncached_tokens: int, prompt_tokens: int, tpot_target_s: float,
             band: int = 0, output_tokens: int = 0, streamed: bool = True) -> Flight:
        """A request of priority ``band`` was placed on the engine; returns its
        handle. ``output_tokens``: the most it may generate (its output cap; 0: not
        known), for :attr:`Flight.expected_s`, which the TPOT̂ at the batch it joins
        prices. ``streamed`` False: the answer comes whole, so its first token is taken
        as seen at ``TTFT̂ + z σ`` after now (:attr:`Flight.first_due`)."""
        now = self.clock.now()
        self._advance(now)
        uncached_tokens = max(0, uncached_tokens)
        ahead = self.pending_prefill_tokens + uncached_tokens
        predicted = self.model.predict_ttft(ahead, self.decoding)
        ttft = predicted.mean
        expected = 0.0
        if output_tokens > 0:
            expected = ttft + self.model.predict_tpot(self.in_flight + 1).mean \
                * (output_tokens - 1)
        flight = Flight(uncached_tokens, prompt_tokens, band, tpot_target_s, now, ahead,
                        self._decoding, ttft, expected)
        self.flights.add(flight)
        self._targets[tpot_target_s] += 1
        self._pending += uncached_tokens
        if not streamed:
            flight.first_due = now + max(0.0, predicted.upper(self.z))
            heapq.heappush(self._due, (flight.first_due, next(self._due_seq), flight))
        return flight

    def first_token(self, flight: Flight) -> None:
        """``flight`` streamed its first token now (or, for an answer that does not
        stream, its :attr:`Flight.first_due` passed, or its whole answer came)."""
        if flight.first_at is not None or flight not in self.flights:
            return
        now = self.clock.now()
        self._advance(now)
        flight.first_at = now
        self._pending -= flight.uncached_tokens
        self._decoding += 1
        self._prefilled += flight.uncached_tokens
        flight.integral_at_first = self._integral
        flight.prefilled_at_first = self._prefilled

    def finished(self, flight: Flight, *, completion_tokens: int = 0,
                 prompt_tokens: int | None = None, cached_tokens: int | None = None,
                 ok: bool = True, streamed: bool = True) -> None:
        """``flight`` ended now (also on error or abort: then ``ok`` is False and
        nothing is learned). ``prompt_tokens`` and ``cached_tokens``: the engine's
        usage (``usage.prompt_tokens_details.cached_tokens``) when it reports them.

        ``streamed`` False: the answer came whole, so it has no TTFT or TPOT of its
        own and the model learns nothing from it (the engine's histograms still
        reach it, :meth:`scraped`); its time per output token, prefill and queue
        included, bounds its TPOT from above and is the fallback controller's delay
        signal (conservative: it reads a long prompt as slow decoding). Without it a
        non-streaming workload on an engine that exports no latency histograms would
        leave the fallback limit at its initial value for good."""
        if flight not in self.flights:
            return
        now = self.clock.now()
        self._advance(now)
        self.flights.discard(flight)
        self._targets[flight.tpot_target_s] -= 1
        if not self._targets[flight.tpot_target_s]:
            del self._targets[flight.tpot_target_s]
        if flight.first_at is None:
            self._pending -= flight.uncached_tokens
        else:
            self._decoding -= 1
        if not ok or flight.first_at is None:
            return
        if not streamed:
            if completion_tokens > 0:
                self.gradient.observe((now - flight.sent_at) / completion_tokens,
                                      flight.tpot_target_s, self.in_flight + 1)
            return
        ttft = flight.first_at - flight.sent_at
        own = flight.uncached_tokens
        if cached_tokens is not None:  # the engine's count replaces the estimate
            own = max(0, (prompt_tokens or flight.prompt_tokens) - cached_tokens)
        ahead = flight.ahead_tokens + own - flight.uncached_tokens
        if ttft > 0:
            self.ttft_errors.append(abs(flight.predicted_ttft_s - ttft) / ttft)
        self.model.observe_ttft(ttft, ahead, flight.decoding_at_send)
        if not self._engine_turnover:
            self.model.observe_turnover(own, completion_tokens, now)
        steps = completion_tokens - 1
        span = now - flight.first_at
        if steps < 1 or span <= 0:
            return
        tpot = span / steps
        mean_batch = (self._integral - flight.integral_at_first) / span
        prefill_per_step = (self._prefilled - flight.prefilled_at_first) / steps
        self.model.observe_tpot(tpot, mean_batch, prefill_per_step, steps)
        self.gradient.observe(tpot, flight.tpot_target_s, self.in_flight + 1)

    def scraped(self, counters: EngineCounters) -> IntervalObservations:
        """The engine's histograms and counters were read: fit the model to the
        interval since the previous scrape (:func:`interval_observations`); returns
        what was observed.

        The interval's TPOT sample joins the fit only when no prefill can have run in
        it: none scheduled in it, and the previous scrape later than the end
        predicted for every prefill scheduled before (its scrape time + TTFT̂ + z σ of
        its uncached tokens). The counters cannot pair a prefill with the decode
        steps it slows: vLLM counts a prompt's tokens
        (``vllm:prefix_cache_queries``) when it schedules it, all of them at once
        with chunked prefill, and the steps' inter-token latencies when they end, a
        step or many later, often in the next interval. Fitted as they came, an
        interval read a prefill that cost nothing and a later one a slow step with
        no prefill: on the simulator the per-prefill-token cost fitted at a fifth to
        half of the true one and the fixed step time rose with it, so after a switch
        to long prompts TPOT̂(1) + z σ read above the target and engines fell to a
        limit of 1. Decode-only intervals fit the step time and the per-sequence
        cost without that error; the prefill interference is learned from the
        requests the gateway sees end, whose prefills fall inside their decode.

        The fallback limiter reads every interval's inter-token latency, prefills
        included (a request's TPOT is the average over its decode, slow steps and
        all), averaged over :data:`GRADIENT_ITL_TAU_S`: read one interval at a time,
        the prefills' slow steps held its limit near 8 on engines whose requests
        decoded well within the target (:mod:`limits.gradient`)."""
        prev, self._counters = self._counters, counters
        if prev is None:
            return IntervalObservations()
        obs = interval_observations(prev, counters)
        if obs.turnover is not None:
            self._engine_turnover = True
            self.model.observe_turnover(*obs.turnover, counters.at)
        clean = obs.uncached <= 0 and prev.at >= self._prefill_until
        if obs.uncached > 0:
            duration = self.model.predict_ttft(obs.uncached, counters.running).upper(self.z)
            self._prefill_until = max(self._prefill_until, counters.at + duration)
        if obs.tpot is not None:
            if clean:
                self.model.observe_tpot(*obs.tpot, request=False)
            w = 1.0 - math.exp(-(counters.at - prev.at) / GRADIENT_ITL_TAU_S)
            self._itl = obs.tpot[0] if self._itl is None else self._itl + w * (
                obs.tpot[0] - self._itl)
            tightest = self.tightest_tpot_s()
            if tightest is not None:
                self.gradient.observe(self._itl, tightest, max(1, round(obs.tpot[1])))
        if obs.ttft is not None:
            self.model.observe_ttft(*obs.ttft)
        return obs

    def drain_errors(self) -> list[float]:
        """The TTFT relative errors recorded since the last call."""
        out, self.ttft_errors = self.ttft_errors, []
        return out
