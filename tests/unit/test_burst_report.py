"""The burst benchmark's goal checks and validate-sim's closed-loop verdict (issue 41)."""

from __future__ import annotations

from loadtest.burst import goals
from loadtest.validate_sim import Row, closed_loop_within


def fig(answered: float, *, timeouts: int = 0, refused: int = 0, with_ra: int | None = None,
        p50: float = 10.0, tokens: float | None = None) -> dict:
    return {"answered_per_s": answered, "timeouts": timeouts, "refused": refused,
            "refused_with_retry_after": refused if with_ra is None else with_ra,
            "latency_s_p50": p50, "tokens_per_s": 32 * answered if tokens is None else tokens}


def test_goals_against_the_peak_direct_rate_and_the_gateways_own_c8() -> None:
    direct = {"1": fig(0.2), "8": fig(0.8), "32": fig(1.6), "128": fig(2.0), "512": fig(0.03)}
    gateway = {"1": fig(0.2), "8": fig(0.79, p50=9.0), "32": fig(1.9, refused=4, p50=15.0),
               "128": fig(1.7, refused=900, with_ra=899, p50=30.0),
               "512": fig(1.85, refused=5000, timeouts=1, p50=17.0)}
    g = goals(direct, gateway)
    assert "1" not in g
    assert g["8"]["answered_ok"] is False and g["8"]["answered_vs_peak"] == 0.395
    assert g["32"] == {"answered_vs_peak": 0.95, "answered_ok": True, "no_timeout": True,
                       "refusals_with_retry_after": True, "latency_p50_vs_c8": 1.667,
                       "latency_ok": True}
    assert g["128"]["refusals_with_retry_after"] is False and g["128"]["latency_ok"] is False
    assert g["512"]["no_timeout"] is False and g["512"]["answered_ok"] is True
    assert g["c8_tokens_vs_direct"] == 0.988 and g["c8_ok"] is True
    # a refusal at c8 fails the c8 goal whatever the throughput
    assert goals(direct, {**gateway, "8": fig(0.8, refused=1)})["c8_ok"] is False


def test_closed_loop_verdict_reads_answered_and_mean_latency_only() -> None:
    rows = [Row("closed_loop_answered_per_s@clients=8", "req/s", 1.0, 1.15),
            Row("closed_loop_latency_ms_mean@clients=8", "ms", 1000.0, 850.0),
            Row("closed_loop_latency_ms_p50@clients=8", "ms", 1000.0, 2000.0),
            Row("ttft_ms@prompt=16", "ms", 100.0, 500.0)]
    assert closed_loop_within(rows) is True
    rows[1] = Row("closed_loop_latency_ms_mean@clients=8", "ms", 1000.0, 1210.0)
    assert closed_loop_within(rows) is False
    assert closed_loop_within(rows[3:]) is None
