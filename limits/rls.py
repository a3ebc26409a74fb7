"""Recursive least squares with exponential forgetting, robust to outliers: the
estimator each of :class:`limits.latency_model.LatencyModel`'s fits runs on.

Ljung & Söderström, "Theory and Practice of Recursive Identification", MIT Press 1983,
ch. 2: gain ``K = P x / (1/w + xᵀ P x)``, ``θ ← θ + K e``, ``P ← (P − K xᵀ P) / λ``,
with the noise variance ``σ²`` estimated from the residuals, so ``σ² (1 + xᵀ P x)``
is the predictive variance. Robustness: samples that are not finite or not positive
are ignored; the innovation is clipped at ``huber_k`` predictive standard deviations
(Huber's M-estimator applied recursively); ``P``'s diagonal is capped at the prior's
(forgetting without excitation cannot wind it up); parameters are kept ≥ 0 (a latency
never falls with load) by projecting the update onto that set in the metric of the
information matrix ``P⁻¹`` (:func:`project_nonnegative`). Why: ``docs/adaptive-admission.md``,
"The model".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def project_nonnegative(theta: np.ndarray, P: np.ndarray) -> np.ndarray:
    """``theta`` projected onto ``θ ≥ 0`` in the norm of ``P⁻¹``: the θ that minimises
    ``(θ − theta)ᵀ P⁻¹ (θ − theta)`` with the negative parameters held at 0, the
    others moved by their covariance with them (``θ_free ← θ_free − P[free, F]
    P[F, F]⁻¹ θ_F``, the fit's conditional mean given ``θ_F = 0``); a parameter that
    turns negative by that move is held at 0 too, and none is released (exact when the
    parameters held are those the constrained minimum holds at 0). This is the
    estimate projection of constrained Kalman filtering with weight ``W = P⁻¹``
    (D. Simon, "Kalman filtering with state constraints: a survey of linear and
    nonlinear algorithms", IET Control Theory & Applications 4(8), 2010, §2.3), the
    minimum-variance estimate on the constraint's active face.

    Clipping the negative parameters at 0 alone ("θ ← max(θ, 0)") is not a projection
    when the parameters are correlated: with a narrow range of batch sizes the fixed
    step time and the per-sequence cost are strongly anti-correlated, an update that
    lowers the prediction moves the one up and the other down past 0, and the clip
    keeps only the rise — the prediction then grows with every sample that says it is
    too high. Seen on the simulated H200 engine in the loaded routing benchmark (issue
    44): two of four engines' fitted step time climbed to thousands of seconds while
    every observed TPOT was 10–30 ms, and those engines stayed in the fallback limiter
    for the whole run.

    Args:
        theta: the unconstrained estimate, shape (n,).
        P: its (symmetric, positive semi-definite) covariance factor, shape (n, n).

    Returns:
        A new array, shape (n,), every entry ≥ 0.
    """
    theta = theta.astype(float, copy=True)
    fixed = np.zeros(theta.shape, dtype=bool)
    for _ in range(theta.size):
        negative = (theta < 0) & ~fixed
        if not negative.any():
            break
        fixed |= negative
        f = np.flatnonzero(fixed)
        try:
            shift = P[:, f] @ np.linalg.solve(P[np.ix_(f, f)], theta[f])
        except np.linalg.LinAlgError:  # a degenerate block: fall back to the clip
            shift = np.zeros_like(theta)
            shift[f] = theta[f]
        theta = theta - shift
        theta[f] = 0.0
    return np.maximum(theta, 0.0)


class RecursiveLeastSquares:
    """``y ≈ θ·x`` fitted one sample at a time (see :mod:`limits.rls`).

    Classical exponentially weighted RLS: ``P`` is the inverse of the weighted
    information matrix ``Σ λ^(n−i) x_i x_iᵀ`` (dimensionless), so the gain does not
    depend on the noise level and a change is tracked within about ``1 / (1 − λ)``
    samples; the noise variance ``σ²`` is estimated separately, as the weighted mean
    of the squared a-priori residuals (each over its expected spread) forgotten at
    the same rate, with ``noise_std²`` counted as one unit-weight sample, and the
    parameters' covariance is ``σ² P``.

    Args:
        prior: initial θ.
        prior_std: standard deviation of each prior parameter (> 0); it also caps the
            parameters' standard deviation.
        noise_std: initial observation noise σ, in y's unit (> 0).
        forgetting: λ in (0, 1]; samples older by n updates weigh λⁿ (effective
            memory ``1 / (1 − λ)`` samples).
        huber_k: innovations are clipped at this many predictive standard deviations.
    """

    def __init__(self, prior: Sequence[float], prior_std: Sequence[float], noise_std: float,
                 forgetting: float = 0.97, huber_k: float = 3.0) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError("forgetting must be in (0, 1]")
        if len(prior) != len(prior_std) or min(prior_std) <= 0 or noise_std <= 0:
            raise ValueError("prior and prior_std must have the same length, std > 0")
        self.theta = np.array(prior, dtype=float)
        self.noise_var = noise_std ** 2
        # σ² = the weighted average of the squared residuals over θ's memory (each
        # forgotten as its sample is), the prior counting as one unit sample
        self._noise_sum, self._noise_weight = self.noise_var, 1.0
        self._p_max = np.square(np.array(prior_std, dtype=float)) / self.noise_var
        self.P = np.diag(self._p_max)
        self._noise_floor = (noise_std * 1e-3) ** 2
        self.forgetting = forgetting
        self.huber_k = huber_k
        self.samples = 0
        self._snapshot()

    def _snapshot(self) -> None:
        # θ and P as tuples: a prediction of a 3-parameter model in plain Python costs
        # a fraction of numpy's per-call overhead, and placement predicts per candidate.
        self._theta_t = tuple(self.theta.tolist())
        self._p_t = tuple(tuple(row) for row in self.P.tolist())

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        """(mean, standard deviation) of a unit-weight y at ``x``: ``θ·x`` and
        ``σ sqrt(1 + xᵀ P x)``."""
        mean = quad = 0.0
        for theta_i, row, xi in zip(self._theta_t, self._p_t, x, strict=True):
            mean += theta_i * xi
            px = 0.0
            for p, xj in zip(row, x, strict=True):
                px += p * xj
            quad += xi * px
        return mean, math.sqrt(self.noise_var * (1 + max(quad, 0.0)))

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> bool:
        """Fit one sample of noise variance ``σ² / weight`` (weighted least squares: a
        sample that averages ``w`` times the observations of a unit one weighs ``w``);
        False (and nothing changes) when ``y`` or ``x`` is not finite, ``y`` ≤ 0 or
        ``weight`` ≤ 0."""
        v = np.asarray(x, dtype=float)
        if not (math.isfinite(y) and y > 0 and np.all(np.isfinite(v))
                and math.isfinite(weight) and weight > 0):
            return False
        px = self.P @ v
        s = 1.0 / weight + float(v @ px)
        e = y - float(self.theta @ v)
        bound = self.huber_k * math.sqrt(self.noise_var * s)
        e_clipped = min(max(e, -bound), bound)
        gain = px / s
        self.P = (self.P - np.outer(gain, px)) / self.forgetting
        self.P = (self.P + self.P.T) / 2
        self.theta = project_nonnegative(self.theta + gain * e_clipped, self.P)
        d = np.diag(self.P)
        over = d > self._p_max
        if over.any():  # scale the offending rows/columns back to the prior's variance
            f = np.ones_like(d)
            f[over] = np.sqrt(self._p_max[over] / d[over])
            self.P = self.P * np.outer(f, f)
        # the a priori residual over its expected spread, E[e²] = σ² s, joins σ² with
        # its weight (a sample averaging a few hundredths of a unit one's observations
        # moves σ² that much less)
        self._noise_sum = self._noise_sum * self.forgetting + weight * e_clipped ** 2 / s
        self._noise_weight = self._noise_weight * self.forgetting + weight
        self.noise_var = max(self._noise_floor, self._noise_sum / self._noise_weight)
        self.samples += 1
        self._snapshot()
        return True
