"""Fallback concurrency limit from normalised delay: a Gradient2-style controller.

While an engine's latency model is not yet trusted (few samples, or its predictions
drifted), its concurrency limit comes from this controller instead. It reads the
*normalised* delay ``TPOT / TPOT target`` of each finished request — not the raw
request latency, which varies a thousandfold with prompt and output length — and
moves the limit as Netflix's Gradient2 limiter does (``concurrency-limits``,
``Gradient2Limit.java``): ``gradient = clamp(tolerance / delay, 0.5, 1)``,
``new = limit × gradient + queue_size``, ``limit ← (1 − smoothing) × limit +
smoothing × new``. With the SLO target in place of Gradient2's long-term RTT the
controller settles where ``delay ≈ tolerance × (1 − queue_size / limit)⁻¹``, just
under the target for the defaults (``tolerance`` 0.9, ``queue_size`` 1). As in
Gradient2, the limit does not grow while fewer than half of it is in use (an idle
engine says nothing about its knee).

Slow start: until the first delay over the tolerance, each sample that shows the
limit in use and the delay within it doubles the estimate before smoothing (the
limit grows by ``smoothing`` × itself per sample, where the additive rule adds
``smoothing × queue_size``), as TCP's slow start finds an unknown capacity in a
number of round trips logarithmic in it (Jacobson, "Congestion Avoidance and
Control", SIGCOMM 1988). From the initial 4 requests the additive rule needs about
five samples per request of limit, and while it climbs the gateway holds requests
back from engines far below their knees: on the Mooncake trace at twice its speed
the four engines sat at limits of 4–9 for the first 25 s while requests queued at the
gateway (issue 44).

The delay must be the SLO's own quantity, a request's mean TPOT, or an average over
as long: the clamp of the gradient to [0.5, 1] makes the controller read noise as
congestion. Samples that are each over the tolerance a fraction ``p`` of the time
pull the limit to about ``2 queue_size / p`` whatever their mean
(:meth:`limits.engine_latency.EngineLatency.scraped` smooths the engines' interval
latencies for that reason).
"""

from __future__ import annotations


class GradientLimiter:
    """Args:
        initial: starting limit, requests (default 4).
        min_limit / max_limit: bounds, requests (default 1 and 256).
        tolerance: normalised delay aimed at (0–1, default 0.9).
        smoothing: weight of each new estimate (0–1, default 0.2).
        queue_size: growth allowance per sample, requests (default 1).
        slow_start: double the estimate per sample until the first delay over the
            tolerance (module docstring; default True).
    """

    def __init__(self, initial: float = 4.0, min_limit: float = 1.0, max_limit: float = 256.0,
                 tolerance: float = 0.9, smoothing: float = 0.2, queue_size: float = 1.0,
                 slow_start: bool = True) -> None:
        self.limit = float(initial)
        self.min_limit, self.max_limit = min_limit, max_limit
        self.tolerance, self.smoothing, self.queue_size = tolerance, smoothing, queue_size
        self.slow_start = slow_start

    def observe(self, tpot_s: float, target_s: float, in_flight: int) -> float:
        """One finished request: its mean TPOT and TPOT target (s), and the requests
        in flight on the engine when it ended. Returns the new limit."""
        if not (tpot_s > 0 and target_s > 0):
            return self.limit
        gradient = min(1.0, max(0.5, self.tolerance * target_s / tpot_s))
        if gradient >= 1.0 and in_flight < self.limit / 2:
            return self.limit  # app-limited: no evidence for a larger limit
        if gradient < 1.0:
            self.slow_start = False
        new = 2 * self.limit if self.slow_start else self.limit * gradient + self.queue_size
        self.limit = min(self.max_limit, max(self.min_limit,
                                             (1 - self.smoothing) * self.limit + self.smoothing * new))
        return self.limit
