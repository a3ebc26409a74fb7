"""A per-engine latency model fitted online: prefill cost (TTFT) and decode step time
(TPOT) as linear functions of the engine's load, with uncertainty.

Model (the cost structure of a continuous-batching iteration: a fixed part plus parts
linear in the prefill tokens and the decoding sequences of the step; Sarathi-Serve,
Agrawal et al., OSDI 2024, §3, and the iteration-level batching of Orca, Yu et al.,
OSDI 2022)::

    TTFT = a0 + a1 × (uncached prefill tokens ahead of and including the request)
              + a2 × (sequences decoding when it was sent)
    TPOT = b0 + b1 × (mean requests in flight while it decoded)
              + b2 × (uncached prefill tokens the engine took per decode step meanwhile)

``a0`` is seconds of overhead, ``a1`` seconds per prefill token, ``a2`` seconds per
decoding sequence (the steps a new request shares with them); ``b0`` is the fixed
step time, ``b1`` seconds per sequence in the batch, ``b2`` the prefill cost that
chunked/mixed batching adds to every running sequence's step.

Predicting TPOT at a batch ``b`` needs the prefill tokens per step a request will
decode alongside: ``ρ b``, with ``ρ`` the engine's turnover of uncached prompt tokens
per generated token over ``turnover_tau_s``, restarted when a faster estimate over
``turnover_fast_tau_s`` rises :data:`TURNOVER_Z` standard deviations above it
(:meth:`LatencyModel.observe_turnover`).

Each is fitted by recursive least squares with exponential forgetting (Ljung &
Söderström, "Theory and Practice of Recursive Identification", MIT Press 1983,
ch. 2): gain ``K = P x / (1/w + xᵀ P x)``, ``θ ← θ + K e``, ``P ← (P − K xᵀ P) / λ``,
with the noise variance ``σ²`` estimated from the residuals, so ``σ² (1 + xᵀ P x)``
is the predictive variance the admission uses (mean + ``z`` standard deviations).
A TPOT sample is weighted ``w`` by its decode steps over the mean steps of the
requests seen to finish, so the predictive spread is that of one request's TPOT.
Robustness: samples that are not finite or not positive are ignored; the innovation
is clipped at ``huber_k`` predictive standard deviations (Huber's M-estimator applied
recursively); ``P``'s diagonal is capped at the prior's (forgetting without
excitation cannot wind it up); parameters are kept ≥ 0 (a latency never falls with
load).

Why each rule is as it is: ``docs/adaptive-admission.md``, "The model".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from limits.rls import RecursiveLeastSquares

#: Share of the fitted model's highest token rate at which the throughput knee sits
#: (:meth:`LatencyModel.throughput_knee`): 90 %, so a further request adds under a
#: tenth of the rate it would add alone while the decode of every running request
#: keeps slowing.
THROUGHPUT_SHARE = 0.9

#: Mean batch up to which a TPOT sample shows the engine's speed alone
#: (:attr:`LatencyModel.alone_observed`).
ALONE_BATCH = 2.0


@dataclass(frozen=True)
class LatencyPrior:
    """Prior parameters of :class:`LatencyModel`, and how far each may be off (1 σ).

    Attributes (seconds):
        ttft_overhead_s: ``a0``.
        prefill_s_per_token: ``a1``, s/token.
        ttft_s_per_seq: ``a2``, s/sequence.
        step_s: ``b0``, the fixed decode step time.
        step_s_per_seq: ``b1``, s/sequence.
        step_s_per_prefill_token: ``b2``, s/token.
        rel_std: each prior's standard deviation as a fraction of it (default 1.0:
            the prior is only an order of magnitude).
    """

    ttft_overhead_s: float = 0.05
    prefill_s_per_token: float = 1e-3
    ttft_s_per_seq: float = 5e-3
    step_s: float = 0.03
    step_s_per_seq: float = 3e-3
    step_s_per_prefill_token: float = 1e-3
    rel_std: float = 1.0


@dataclass(frozen=True)
class Prediction:
    """A predicted latency, s: ``mean`` and its standard deviation ``std``."""

    mean: float
    std: float

    def upper(self, z: float) -> float:
        """``mean + z × std``, s."""
        return self.mean + z * self.std


#: Standard deviations by which the fast turnover estimate's prefill tokens must exceed
#: what the older spans' ratio expects for them to restart the slow one
#: (:meth:`LatencyModel.observe_turnover`): one-sided, 0.13 % of independent tests of a
#: steady Poisson mix.
TURNOVER_Z = 3.0


@dataclass
class _TurnoverSums:
    """Exponentially decayed sums of turnover spans: uncached prompt tokens, generated
    tokens, and the squares of each span's uncached tokens (the spread of the
    prefill they bring); ``at``: clock time of the last span, s."""

    uncached: float = 0.0
    generated: float = 0.0
    squares: float = 0.0
    at: float | None = None

    def add(self, uncached: float, generated: float, at: float, tau_s: float) -> None:
        w = 1.0 if self.at is None else math.exp(-max(0.0, at - self.at) / tau_s)
        self.uncached = self.uncached * w + uncached
        self.generated = self.generated * w + generated
        self.squares = self.squares * w + uncached * uncached
        self.at = at


class LatencyModel:
    """The TTFT and TPOT regressions of one engine.

    Args:
        prior: starting parameters.
        forgetting: RLS forgetting factor λ per sample (default 0.97: about the last
            33 requests weigh most, so a change of speed or workload is followed
            within tens of requests).
        min_samples: TPOT samples before :attr:`confident` can be true (default 20).
        max_rel_error: :attr:`confident` also needs the EWMA of the TPOT relative
            prediction error below this (default 0.35).
        turnover_tau_s: time constant of the turnover ratio ``ρ``, s (default 20: a
            few generations of a typical chat request).
        turnover_fast_tau_s: time constant of the faster estimate that tells a change
            of the prompt mix (:meth:`observe_turnover`), s (default 4: a dozen
            prefills on an engine at a few requests per second).
    """

    def __init__(self, prior: LatencyPrior = LatencyPrior(), *, forgetting: float = 0.97,
                 min_samples: int = 20, max_rel_error: float = 0.35,
                 turnover_tau_s: float = 20.0, turnover_fast_tau_s: float = 4.0) -> None:
        r = prior.rel_std
        a = (prior.ttft_overhead_s, prior.prefill_s_per_token, prior.ttft_s_per_seq)
        b = (prior.step_s, prior.step_s_per_seq, prior.step_s_per_prefill_token)
        self.ttft = RecursiveLeastSquares(a, [max(v * r, 1e-6) for v in a], a[0], forgetting)
        self.tpot = RecursiveLeastSquares(b, [max(v * r, 1e-6) for v in b], b[0] / 2, forgetting)
        self.min_samples = min_samples
        self.max_rel_error = max_rel_error
        #: EWMA of |TPOT̂ − TPOT| / TPOT over the last samples (before each update)
        self.tpot_rel_error = 1.0
        #: ``ρ``: uncached prompt tokens per generated token, recent (docs/adaptive-admission.md)
        self.prefill_per_token = 0.0
        self.turnover_tau_s = turnover_tau_s
        self.turnover_fast_tau_s = turnover_fast_tau_s
        self._turnover = _TurnoverSums()
        self._turnover_fast = _TurnoverSums()
        self._knee: tuple[tuple, int] | None = None
        #: EWMA of the decode steps of the requests seen to finish (None before one)
        self.request_steps: float | None = None
        self._since_alone = math.inf  # TPOT samples since the last at ≤ ALONE_BATCH
        #: (mean batch, TPOT s) of the samples at ≤ ALONE_BATCH, weighted means
        #: (EWMA by sample weight), never forgotten by time: the engine's speed alone
        self._alone: tuple[float, float] | None = None
        #: weighted mean batch of the recent TPOT samples (EWMA): where the engine runs
        self._batch_seen: float | None = None

    # ------------------------------------------------------------------ predictions

    def predict_ttft(self, prefill_tokens: float, decoding: float) -> Prediction:
        """TTFT of a request sent now, s: ``prefill_tokens`` uncached tokens ahead of
        it and its own; ``decoding`` sequences generating on the engine."""
        return Prediction(*self.ttft.predict((1.0, prefill_tokens, decoding)))

    def predict_tpot(self, batch: float, prefill_per_step: float | None = None) -> Prediction:
        """TPOT at ``batch`` requests in flight, s; prefill interference at
        ``prefill_per_step`` tokens per step (default: the turnover's, ``ρ × batch``)."""
        p = self.prefill_per_token * batch if prefill_per_step is None else prefill_per_step
        return Prediction(*self.tpot.predict((1.0, batch, p)))

    def tpot_alone_s(self, z: float = 0.0) -> float:
        """TPOT̂ (+ ``z`` σ) of one request alone, with the turnover's prefill
        interference (``predict_tpot(1).upper(z)``), s. A concurrency limit that meets
        a TPOT target exists only when this is within the target (:meth:`knee` returns
        1 either way)."""
        return self.predict_tpot(1).upper(z)

    def knee(self, tpot_target_s: float, z: float = 0.0, *, cap: int = 1024) -> int:
        """The largest batch ``b`` (≥ 1, ≤ ``cap``) whose TPOT̂ (+ ``z`` σ) meets
        ``tpot_target_s``: the concurrency limit this model implies. Remembered until
        the TPOT fit or the turnover ratio changes (placement asks per request and per
        engine)."""
        key = (tpot_target_s, z, cap, self.tpot.samples, self.prefill_per_token)
        if self._knee is not None and self._knee[0] == key:
            return self._knee[1]
        lo, hi = 1, cap
        while lo < hi:  # TPOT̂ is non-decreasing in the batch (θ ≥ 0)
            mid = (lo + hi + 1) // 2
            if self.predict_tpot(mid).upper(z) <= tpot_target_s:
                lo = mid
            else:
                hi = mid - 1
        self._knee = (key, lo)
        return lo

    def throughput_knee(self, share: float = THROUGHPUT_SHARE, *, cap: int = 1024) -> int:
        """The concurrency past which the engine's token rate no longer grows much:
        the smallest batch ``b`` (≥ 1, ≤ ``cap``) whose predicted rate ``b / TPOT̂(b)``
        reaches ``share`` of the most the fit allows. With ``TPOT̂(b) = t0 + c b``
        (``t0 = b0``, ``c = b1 + b2 ρ``: the step time's per-sequence part with the
        turnover's prefill per sequence) the rate ``b / (t0 + c b)`` rises towards
        ``1 / c`` and reaches ``share / c`` at ``b = share t0 / ((1 − share) c)``
        (the saturation knee of a linear step-time model; Sarathi-Serve, Agrawal et
        al., OSDI 2024, §3: decode batches amortise the fixed step until the
        per-sequence work dominates). Past it each added request buys under
        ``(1 − share)`` of the rate while lengthening every running request's decode
        by ``c`` per token, so admission at best effort (no SLO any batch can meet)
        holds the engine there (:meth:`limits.engine_latency.EngineLatency.limit`).
        Predicted means: this is throughput, not a latency promise. ``cap`` where the
        fit sees no per-sequence cost (``c = 0``: the rate grows without bound).

        ``t0`` and ``c`` come from two points: the engine's TPOT alone (the weighted
        mean of its samples at a batch of at most :data:`ALONE_BATCH`, kept however
        old) and TPOT̂ at the batch it runs at now (the recent samples' mean batch,
        where the fit is best identified). The fit's own intercept and slope are
        used only before the engine was seen alone or while it runs near alone: held
        at one batch, the fit sees no spread of batches and the two trade off freely
        (seen on the simulated CPU engine at best effort: the intercept fell from
        9 ms to 0 within seconds at a steady 24 in flight, which would put the knee
        at 1).

        Raises:
            ValueError: ``share`` not in (0, 1).
        """
        if not 0 < share < 1:
            raise ValueError("share must be in (0, 1)")
        b = self._batch_seen
        if self._alone is not None and b is not None and b >= 2 * ALONE_BATCH:
            b_alone, t_alone = self._alone
            per_seq = (self.predict_tpot(b).mean - t_alone) / (b - b_alone)
            t0 = t_alone - per_seq * b_alone
        else:
            t0 = self.predict_tpot(0).mean
            per_seq = self.predict_tpot(1).mean - t0
        if per_seq <= 0:
            return cap
        return max(1, min(cap, math.ceil(share * max(0.0, t0) / ((1 - share) * per_seq))))

    def prefill_budget(self, tpot_target_s: float, batch: float,
                       stall_s: float | None = None) -> float | None:
        """The most uncached prompt tokens one decode step at ``batch`` sequences may
        carry while TPOT̂ (mean) stays within ``tpot_target_s`` (s): ``(τ − b0 − b1 ×
        batch) / b2``, Sarathi-Serve's token budget (Agrawal et al., OSDI 2024, §4)
        from the fitted step time; or, given ``stall_s``, the tokens that add that
        much to a step, ``stall_s / b2``. Tokens, ≥ 0; None where the fit sees no
        prefill interference (``b2`` = 0)."""
        b0, b1, b2 = self.tpot.theta
        if b2 <= 0:
            return None
        room = tpot_target_s - b0 - b1 * batch if stall_s is None else stall_s
        return max(0.0, room) / b2

    @property
    def alone_observed(self) -> bool:
        """Whether the TPOT fit still remembers a sample at a mean batch of at most
        :data:`ALONE_BATCH`: one within its last ``1 / (1 − λ)`` samples (the
        memory of the forgetting factor λ). Without one, TPOT̂(1) is an extrapolation
        from larger batches, where a narrow range of batch sizes leaves the fixed
        step time and the per-sequence slope collinear, so the intercept can drift
        far from the engine's speed alone."""
        memory = math.inf if self.tpot.forgetting >= 1 else 1 / (1 - self.tpot.forgetting)
        return self._since_alone < memory

    @property
    def ttft_trusted(self) -> bool:
        """Whether the TTFT fit has ``min_samples`` samples (TTFT̂ may then hold a
        request back; before, its prior would)."""
        return self.ttft.samples >= self.min_samples

    @property
    def confident(self) -> bool:
        """Whether admission may use the model (else the gradient limiter)."""
        return self.tpot.samples >= self.min_samples and self.tpot_rel_error <= self.max_rel_error

    def params(self) -> dict[str, float]:
        """The fitted parameters by name (s, s/token, s/sequence), the TPOT noise ``σ``
        (s), the turnover ratio ``ρ`` (uncached prompt tokens per output token) and
        the TPOT fit's recent relative prediction error (ratio; :attr:`confident`
        needs it at most ``max_rel_error``)."""
        a, b = self.ttft.theta, self.tpot.theta
        return {"ttft_overhead_s": a[0], "prefill_s_per_token": a[1], "ttft_s_per_seq": a[2],
                "step_s": b[0], "step_s_per_seq": b[1], "step_s_per_prefill_token": b[2],
                "tpot_noise_s": math.sqrt(self.tpot.noise_var),
                "prefill_tokens_per_output_token": self.prefill_per_token,
                "tpot_rel_error": self.tpot_rel_error}

    # ------------------------------------------------------------------ observations

    def observe_ttft(self, ttft_s: float, prefill_tokens: float, decoding: float) -> bool:
        """One request's TTFT (s) with the features it was sent with."""
        return self.ttft.update((1.0, prefill_tokens, decoding), ttft_s)

    def observe_tpot(self, tpot_s: float, mean_batch: float, prefill_per_step: float,
                     steps: float, *, request: bool = True) -> bool:
        """A mean TPOT (s) over ``steps`` decode steps, the mean requests in flight and
        the prefill tokens per decode step during them: one request's decode
        (``request``) or a metrics interval's. Its weight is ``steps`` over
        :attr:`request_steps` (1 before a request was seen to finish); the relative
        error behind :attr:`confident` moves by ``0.1 ×`` that weight (at most 0.1)."""
        if not (math.isfinite(tpot_s) and tpot_s > 0 and steps > 0):
            return False
        if request:
            self.request_steps = steps if self.request_steps is None else \
                self.request_steps + 0.1 * (steps - self.request_steps)
        weight = steps / self.request_steps if self.request_steps else 1.0
        predicted = self.predict_tpot(mean_batch, prefill_per_step).mean
        self.tpot_rel_error += 0.1 * min(1.0, weight) * (
            min(abs(predicted - tpot_s) / tpot_s, 2.0) - self.tpot_rel_error)
        if not self.tpot.update((1.0, mean_batch, prefill_per_step), tpot_s, weight):
            return False
        self._since_alone = 0 if mean_batch <= ALONE_BATCH else self._since_alone + 1
        a = 0.1 * min(1.0, weight)
        self._batch_seen = mean_batch if self._batch_seen is None else \
            self._batch_seen + a * (mean_batch - self._batch_seen)
        if mean_batch <= ALONE_BATCH:
            old = self._alone or (mean_batch, tpot_s)
            self._alone = (old[0] + a * (mean_batch - old[0]), old[1] + a * (tpot_s - old[1]))
        return True

    def observe_turnover(self, uncached_tokens: float, generated_tokens: float,
                         at: float) -> None:
        """The engine prefilled ``uncached_tokens`` and generated ``generated_tokens``
        in a span ending at clock time ``at`` (s): both join sums decayed by
        ``exp(−Δt / turnover_tau_s)``, whose ratio is ``ρ``, and faster ones decayed
        with ``turnover_fast_tau_s``. Negative counts are ignored.

        When the fast sums' prefill ``U_f`` exceeds what the older spans' ratio
        expects of their generated tokens ``N_f`` by more than :data:`TURNOVER_Z`
        standard deviations, ``U_f − ρ_o N_f > Z √(N_f Q_o / (2 N_o))``, the slow
        sums restart at the fast ones (an average restarted at a detected change, as
        the arrival rates do: :meth:`limits.band_demand.BandDemand.rates`). The
        older spans are the slow sums less the fast ones (each span weighs
        ``e^(−Δt/τs) − e^(−Δt/τf)`` there, so the recent spans under test do not
        widen their own yardstick); ``Q_o / N_o``, their squared span prefill per
        generated token, is the variance per generated token of the prefill a
        compound Poisson stream of that mix brings (Campbell's theorem; the ``2`` is
        ``Σw / Σw²`` of the fast kernel; a span that holds two prefills overstates
        it, which only makes the test stricter). Only a rise restarts: it lowers the
        knee, where a fall read from a chance lull would raise it past what the mix
        allows."""
        if uncached_tokens < 0 or generated_tokens < 0:
            return
        slow, fast = self._turnover, self._turnover_fast
        slow.add(uncached_tokens, generated_tokens, at, self.turnover_tau_s)
        fast.add(uncached_tokens, generated_tokens, at, self.turnover_fast_tau_s)
        if slow.generated <= 0:
            return
        rho = slow.uncached / slow.generated
        older = slow.generated - fast.generated
        if older > 0 and fast.generated > 0:
            rho_o = max(0.0, slow.uncached - fast.uncached) / older
            var = max(0.0, slow.squares - fast.squares) / older * fast.generated / 2
            if fast.uncached - rho_o * fast.generated > TURNOVER_Z * math.sqrt(var):
                self._turnover = dataclasses.replace(fast)
                rho = fast.uncached / fast.generated
        self.prefill_per_token = rho
