"""The p90 TTFT lower bound of the routing benchmark (loadtest.ttft_bound): McNaughton's
room per arrival instant, its least T, and that real schedules never beat it."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from loadtest.replay import replayed_ttft_p90_bound_ms
from loadtest.sim_engine.profiles import get_profile
from loadtest.ttft_bound import on_time_bound, percentile_bound_s, prefill_seconds
from loadtest.workloads.base import WorkloadOptions
from loadtest.workloads.mooncake import ideal_hits, trace_path

H200 = get_profile("h200-llama3-8b")


def test_prefill_seconds_counts_chunked_steps() -> None:
    one = H200.step_fixed_s + 8192 * H200.prefill_token_s
    assert prefill_seconds(H200, 8192) == pytest.approx(one)
    assert prefill_seconds(H200, 8193) == pytest.approx(one + H200.step_fixed_s
                                                        + H200.prefill_token_s)
    assert prefill_seconds(H200, 0) == prefill_seconds(H200, 1)


def test_on_time_bound_fills_each_instants_room_with_its_smallest_jobs() -> None:
    burst = [(0.0, s) for s in (1, 1, 1, 1, 3)]
    assert on_time_bound(burst, 2, 2.0) == 4  # room 4: the four 1s; 3 > T
    assert on_time_bound(burst, 2, 3.0) == 4  # room 6: 3 no longer fits after 4
    assert on_time_bound(burst, 2, 3.5) == 5  # room 7
    # a second instant has its own room, however close it follows
    assert on_time_bound(burst + [(0.1, 2.0)], 2, 2.0) == 5


def test_percentile_bound_is_the_least_t_reaching_the_rank() -> None:
    jobs = [(0.0, s) for s in (1, 1, 1, 1, 3)] + [(10.0, 0.5)] * 5
    # numpy's p90 of 10 values interpolates from the 9th smallest: 9 must be on time
    t = percentile_bound_s(jobs, 2, 90.0)
    assert on_time_bound(jobs, 2, t) >= 9 > on_time_bound(jobs, 2, t * (1 - 1e-6))
    assert t == pytest.approx(2.0)  # the burst's four 1s on 2 engines; the 0.5s need 1.25
    with pytest.raises(ValueError):
        percentile_bound_s([], 2)


def fcfs_least_work(jobs: list[tuple[float, float]], engines: int) -> list[float]:
    """TTFTs of a real schedule: each job to the engine that frees first, FCFS."""
    free = [0.0] * engines
    out = []
    for at, size in jobs:
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + size)
        out.append(start + size - at)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_no_real_schedule_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    jobs = sorted((float(rng.randrange(0, 20, 3)), rng.lognormvariate(-1, 1))
                  for _ in range(80))
    for engines in (1, 4):
        real = float(np.percentile(fcfs_least_work(jobs, engines), 90))
        assert real >= percentile_bound_s(jobs, engines) - 1e-9


@pytest.mark.skipif(not trace_path().exists(), reason="Mooncake trace not present")
def test_bound_of_the_replayed_mooncake_slice() -> None:
    opts = WorkloadOptions(duration_s=60.0)
    four = replayed_ttft_p90_bound_ms("mooncake-conversation", opts, H200, 4, 1.0)
    eight = replayed_ttft_p90_bound_ms("mooncake-conversation", opts, H200, 8, 1.0)
    # 162 requests at 20 instants: the bursts, not the prompts alone, set it
    assert 850 < eight < four < 1100
    assert replayed_ttft_p90_bound_ms("short", opts, H200, 4, 1.0) is None
    assert ideal_hits([{"hash_ids": [1, 2], "input_length": 700},
                       {"hash_ids": [1, 3], "input_length": 600}], 512) == [0, 512]
