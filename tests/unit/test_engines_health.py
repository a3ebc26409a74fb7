"""Pure supervisor rules: restart backoff and "busy but alive"."""

from __future__ import annotations

from engines.health import backoff_delay, made_progress
from engines.pool import MetricsSnapshot


def test_backoff_doubles_then_caps() -> None:
    assert [backoff_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(1, 0.5, 60.0) == 0.5
    assert backoff_delay(0, 0.5, 60.0) == 0.5


def test_no_metrics_or_stale_metrics_is_no_progress() -> None:
    assert not made_progress(None, None, 10.0, 5.0)
    stale = MetricsSnapshot(at=1.0, num_running=4)
    assert not made_progress(None, stale, 10.0, 5.0)


def test_generating_is_progress_but_stuck_running_requests_are_not() -> None:
    before = MetricsSnapshot(at=8.0, num_running=1, generation_tokens=100)
    generating = MetricsSnapshot(at=9.0, num_running=1, generation_tokens=140)
    stuck = MetricsSnapshot(at=9.0, num_running=1, generation_tokens=100)
    assert made_progress(before, generating, 10.0, 5.0)
    assert not made_progress(before, stuck, 10.0, 5.0)


def test_moving_counters_are_progress_only_across_scrapes() -> None:
    before = MetricsSnapshot(at=8.0, prefix_cache_queries=10)
    moved = MetricsSnapshot(at=9.0, prefix_cache_queries=50)
    same = MetricsSnapshot(at=9.0, prefix_cache_queries=10)
    assert made_progress(before, moved, 10.0, 5.0)
    assert not made_progress(before, same, 10.0, 5.0)
    assert not made_progress(moved, moved, 10.0, 5.0)  # no new scrape since
