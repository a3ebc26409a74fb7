"""The fallback concurrency limit while an engine's latency model is not trusted
(limits.gradient, fed by limits.engine_latency): slow start, and the scraped
inter-token latency it reads (issue 44: limits held at 4–9 below the engines' knees)."""

from __future__ import annotations

import dataclasses

from limits.engine_latency import EngineCounters, EngineLatency
from limits.gradient import GradientLimiter
from limits.latency_model import LatencyModel
from tests.support import ManualClock


def grow(g: GradientLimiter, samples: int, tpot_s: float = 0.05) -> float:
    """``samples`` good delays (TPOT ``tpot_s`` against 100 ms) with the limit in use."""
    for _ in range(samples):
        g.observe(tpot_s, 0.1, round(g.limit))
    return g.limit


def test_slow_start_finds_a_large_knee_in_a_few_samples() -> None:
    # each sample within the tolerance grows the estimate by a fifth of itself
    assert grow(GradientLimiter(initial=4), 12) > 30
    # the additive rule alone: a fifth of a request per sample
    assert grow(GradientLimiter(initial=4, slow_start=False), 12) < 7


def test_slow_start_ends_at_the_first_delay_over_the_tolerance() -> None:
    g = GradientLimiter(initial=4)
    grow(g, 5)
    before = g.limit
    g.observe(0.12, 0.1, round(g.limit))  # over 0.9 × the target: the limit falls
    assert not g.slow_start and g.limit < before
    after = g.limit
    assert grow(g, 5) < after + 1.01  # additive from here: +0.2 per sample


def test_slow_start_does_not_grow_an_idle_engine() -> None:
    g = GradientLimiter(initial=8)
    for _ in range(50):
        g.observe(0.01, 0.1, 2)  # under half the limit in use: no evidence
    assert g.limit == 8 and g.slow_start


def test_prefill_steps_in_scrape_intervals_do_not_hold_the_limit_down() -> None:
    """A quarter of the 0.25 s scrape intervals hold a long prompt's prefill steps
    (ITL 150 ms against a 100 ms target), the rest decode at 40 ms: requests decoding
    through them average 55 ms, well within the target. Read interval by interval, the
    clamped gradient took a quarter of the intervals as congestion and held the limit
    near 2 / 0.25 = 8; averaged over 2 s the limit grows on."""
    clock = ManualClock()
    eng = EngineLatency(LatencyModel(), clock, gradient=GradientLimiter(initial=4,
                                                                       slow_start=False))
    eng.sent(100, 100, 0.1)  # a request in flight: its TPOT target is the one read
    c = EngineCounters(at=0.0, load=4, running=4, itl_sum_s=0.0, itl_count=0)
    eng.scraped(c)
    for i in range(1200):  # 5 minutes of scrapes
        itl = 0.150 if i % 4 == 0 else 0.040
        tokens = round(0.25 / itl * c.load)
        load = max(4, round(eng.gradient.limit))  # the engine kept at its limit
        c = dataclasses.replace(c, at=c.at + 0.25, load=load, running=load,
                                itl_sum_s=c.itl_sum_s + itl * tokens,
                                itl_count=c.itl_count + tokens)
        eng.scraped(c)
    assert eng.gradient.limit > 30
