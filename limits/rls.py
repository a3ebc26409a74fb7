"""Recursive least squares with exponential forgetting, robust to outliers: the
estimator each of :class:`limits.latency_model.LatencyModel`'s fits runs on.

Ljung & Söderström, "Theory and Practice of Recursive Identification", MIT Press 1983,
ch. 2: gain ``K = P x / (1/w + xᵀ P x)``, ``θ ← θ + K e``, ``P ← (P − K xᵀ P) / λ``,
with the noise variance ``σ²`` estimated from the residuals, so ``σ² (1 + xᵀ P x)``
is the predictive variance. Robustness: samples that are not finite or not positive
are ignored; the innovation is clipped at ``huber_k`` predictive standard deviations
(Huber's M-estimator applied recursively); ``P``'s diagonal is capped at the prior's
(forgetting without excitation cannot wind it up); parameters are kept ≥ 0 (a latency
never falls with load). Why: ``docs/adaptive-admission.md``, "The model".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


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
        self.theta = np.maximum(self.theta + gain * e_clipped, 0.0)
        self.P = (self.P - np.outer(gain, px)) / self.forgetting
        self.P = (self.P + self.P.T) / 2
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
