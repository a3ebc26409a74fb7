"""What one interval between two scrapes of an engine's histograms and counters says
about its latency model (rules: docs/adaptive-admission.md, "Observations"); the
ledger (:meth:`limits.engine_latency.EngineLatency.scraped`) fits it.
"""

from __future__ import annotations

from dataclasses import dataclass

from limits.interfaces import EngineCounters


@dataclass(frozen=True)
class IntervalObservations:
    """What one scrape interval says about the model (:func:`interval_observations`);
    each is None when the interval holds no such sample.

    Attributes:
        tpot: (mean inter-token latency s, mean running + waiting, uncached prefill
            tokens per decode step, decode steps in the interval).
        ttft: (mean prefill time s, mean computed prompt tokens per request, mean
            running).
        turnover: (uncached prompt tokens, generated tokens) of the interval.
        uncached: uncached prompt tokens the engine scheduled in the interval.
    """

    tpot: tuple[float, float, float, float] | None = None
    ttft: tuple[float, float, float] | None = None
    turnover: tuple[float, float] | None = None
    uncached: float = 0.0


#: Fewest decoded tokens in an interval for its mean inter-token latency to count.
MIN_INTERVAL_TOKENS = 4


def interval_observations(prev: EngineCounters, now: EngineCounters) -> IntervalObservations:
    """The model's samples in the interval between two scrapes (rules:
    docs/adaptive-admission.md, "Observations"). Counters that fell (an engine
    restart) or an interval with no time yield nothing; the TPOT sample needs
    :data:`MIN_INTERVAL_TOKENS` decoded tokens, the TTFT sample a finished request
    with its computed tokens."""
    dt = now.at - prev.at
    if dt <= 0:
        return IntervalObservations()

    def delta(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b < a else b - a

    tpot = ttft = turnover = None
    hits = delta(prev.cached_tokens, now.cached_tokens) or 0.0
    loaded = delta(prev.external_tokens, now.external_tokens) or 0.0
    queried = delta(prev.queried_tokens, now.queried_tokens)
    if queried is not None:  # counted together with the hits, local and loaded
        uncached = max(0.0, queried - hits - loaded)
    else:
        uncached = max(0.0, (delta(prev.prompt_tokens, now.prompt_tokens) or 0.0) - hits)
    generated = delta(prev.generated_tokens, now.generated_tokens)
    if generated is not None:
        turnover = (uncached, generated)
    n_itl, s_itl = delta(prev.itl_count, now.itl_count), delta(prev.itl_sum_s, now.itl_sum_s)
    if n_itl is not None and s_itl is not None and n_itl >= MIN_INTERVAL_TOKENS and s_itl > 0:
        itl = s_itl / n_itl
        steps = max(1.0, dt / itl)  # each decode step takes about one inter-token latency
        tpot = (itl, (prev.load + now.load) / 2, uncached / steps, steps)
    n = delta(prev.prefill_count, now.prefill_count)
    s_prefill = delta(prev.prefill_sum_s, now.prefill_sum_s)
    computed = delta(prev.computed_tokens, now.computed_tokens)
    if n and s_prefill and computed is not None:
        ttft = (s_prefill / n, computed / n, (prev.running + now.running) / 2)
    return IntervalObservations(tpot, ttft, turnover, uncached)
