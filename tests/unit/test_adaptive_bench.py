"""The adaptive benchmark's pooling of repeated runs, its interactive oracle and the
shift run's settling figures (``loadtest/adaptive.py``)."""

from __future__ import annotations

import pytest

from loadtest.adaptive import (
    attainment_tolerance,
    oracle_interactive,
    parse_args,
    pooled,
    repeat_seed,
    shift_figures,
)
from loadtest.overload import Outcome
from loadtest.workloads import RequestSpec


def _served(priority: str, ttft_s: float, tpot_s: float = 0.05, tokens: int = 11) -> Outcome:
    return Outcome(tenant="t", priority=priority, sent_s=0.0, status=200, ttft_s=ttft_s,
                   tpot_s=tpot_s, completion_tokens=tokens)


def _shed(priority: str) -> Outcome:
    return Outcome(tenant="t", priority=priority, sent_s=0.0, status=503,
                   error_code="overloaded")


def test_pooled_counts_every_request_over_the_total_window() -> None:
    first = [_served("interactive", 0.2), _served("batch", 0.3), _shed("batch")]
    second = [_served("interactive", 1.5), _served("standard", 0.4, tpot_s=0.2)]
    out = pooled([first, second], 10.0, [{"batch:overloaded:predicted_miss": 1},
                                         {"batch:overloaded:predicted_miss": 2,
                                          "standard:overloaded:queue_full": 1}])
    assert out["goodput"] == 2 / 20.0  # 2 good (the 1.5 s TTFT and 200 ms TPOT miss)
    assert out["runs"] == [0.2, 0.0]
    assert out["slo_attainment"] == {"interactive": 0.5, "standard": 0.0, "batch": 0.5}
    assert out["offered"] == 5 and out["served"] == 4
    assert out["shed_reasons"] == {"batch:overloaded:predicted_miss": 3,
                                   "standard:overloaded:queue_full": 1}
    assert "shed_reasons" not in pooled([first], 10.0)


def test_oracle_returns_counts_of_an_fcfs_schedule() -> None:
    # two slots; three interactive arrivals at 0 s, each 0.1 s TTFT + 10 × 0.15 s
    # decode = 1.6 s: the third starts at 1.6 s, past the 1 s TTFT target
    specs = [RequestSpec(at_s=0.0, tenant="t", priority="interactive", body={})
             for _ in range(3)] + [RequestSpec(at_s=0.0, tenant="t", priority="batch", body={})]
    run = [_served("interactive", 0.1, tpot_s=0.15) for _ in range(3)] + [_shed("batch")]
    assert oracle_interactive(specs, [run], 40.0, slots=2) == (2, 3)
    assert oracle_interactive(specs, [run], 40.0, slots=3) == (3, 3)
    assert oracle_interactive(specs[3:], [run[3:]], 40.0, slots=2) is None


def test_repeats_use_distinct_seeds_and_quick_runs_once() -> None:
    args = parse_args(["--json", "x"])
    assert args.repeat == 3
    seeds = {repeat_seed(args, k, r) for k in (1, 2, 3) for r in range(args.repeat)}
    assert len(seeds) == 9 and repeat_seed(args, 1, 0) == 1  # the first is the old seed
    assert parse_args(["--json", "x", "--quick"]).repeat == 1
    assert parse_args(["--json", "x", "--quick", "--repeat", "2"]).repeat == 2


def _shift_run(late: bool) -> tuple[list[tuple[float, float]], list[Outcome]]:
    """One 60 s shift run with 20 s phases: the limit 4, 2, 4 by phase, sampled every
    0.5 s, and 4 interactive requests per 5 s window, all good; ``late``: the limit
    stays 4 until 25 s and one of the 25–30 s window's requests misses its TTFT."""
    limits = [(t / 2, 2.0 if 20 <= t / 2 < 40 and not (late and t / 2 < 25) else 4.0)
              for t in range(120)]
    outs = [Outcome(tenant="t", priority="interactive", sent_s=w * 5 + j + 0.5, status=200,
                    ttft_s=1.5 if late and w == 5 and j == 0 else 0.2, tpot_s=0.05,
                    completion_tokens=10)
            for w in range(12) for j in range(4)]
    return limits, outs


def test_shift_judges_settling_on_the_repeats_together() -> None:
    runs = [_shift_run(late=True), _shift_run(late=False), _shift_run(late=False)]
    out = shift_figures([r[0] for r in runs], [r[1] for r in runs], 20.0)
    # one run alone: its limit is 2 off the phase's 2 until 24.5 s (tolerance 1) and
    # its 25-30 s window is at 0.75, 0.25 off (tolerance 0.1): settled 10 s in
    assert out["runs"] == [{"convergence_s": 10.0, "worst_window_attainment": 0.875},
                           {"convergence_s": 0.0, "worst_window_attainment": 1.0},
                           {"convergence_s": 0.0, "worst_window_attainment": 1.0}]
    # together: the limit bins average 8/3 (0.67 off), the window 11/12 (0.083 off)
    assert out["convergence_s"] == 0.0 and out["convergence_by_switch_s"] == [0.0, 0.0]
    assert out["worst_window_attainment"] == 23 / 24
    assert out["limit_by_phase"] == [4.0, 2.2, 4.0]
    assert out["summary"]["offered"] == 144 and out["summary"]["goodput"] == 143 / 180
    alone = shift_figures([runs[0][0]], [runs[0][1]], 20.0)
    assert alone["convergence_s"] == 10.0 and alone["convergence_by_switch_s"] == [10.0, 0.0]


def test_settling_allows_a_window_its_binomial_noise() -> None:
    """A long phase that serves 80 % of 25 interactive requests per 5 s window: one
    window at 68 % (0.12 off, within 2 √(0.8 × 0.2 / 25) = 0.16) is noise, one at
    52 % a dip; the last window of the phase (75–80 s) is judged in it."""
    assert attainment_tolerance(1.0, 8) == 0.1
    assert attainment_tolerance(0.8, 25) == pytest.approx(0.16)

    def run(bad: dict[int, int]) -> tuple[list[tuple[float, float]], list[Outcome]]:
        """Windows 8–15 (40–80 s) of 25 requests, 5 of them (or ``bad[w]``) late;
        the others of 4 requests, all good."""
        limits = [(t / 2, 4.0) for t in range(240)]
        outs = [Outcome(tenant="t", priority="interactive", sent_s=w * 5 + j * 0.2,
                        status=200, ttft_s=1.5 if j < bad.get(w, 5 if 8 <= w < 16 else 0)
                        else 0.2, tpot_s=0.05, completion_tokens=10)
                for w in range(24) for j in range(25 if 8 <= w < 16 else 4)]
        return limits, outs

    noisy = shift_figures(*[[x] for x in run({14: 8})], 40.0)
    assert noisy["convergence_by_switch_s"] == [0.0, 0.0]
    dip = shift_figures(*[[x] for x in run({10: 12})], 40.0)
    assert dip["convergence_by_switch_s"] == [15.0, 0.0]  # settled from 55 s
    late = shift_figures(*[[x] for x in run({15: 12})], 40.0)
    assert late["convergence_by_switch_s"] == [40.0, 0.0]  # the phase's last window
