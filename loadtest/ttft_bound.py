"""A lower bound on the p90 TTFT of a replayed trace, whatever the routing and
scheduling: from the trace's arrival instants, its ideal prefix-cache hits and the
simulator profile's prefill speed (the routing benchmark's ``ttft_p90_bound_ms``).

Relaxation — every real schedule is one of these, so the bound holds for all of them:
``engines`` identical engines; each request needs only the prefill of its tokens not in
an unlimited prefix cache (:func:`~loadtest.workloads.mooncake.ideal_hits`), which
takes :func:`prefill_seconds` on one idle engine (the profile's chunked-prefill steps,
no decoding sharing them); requests may be preempted and moved between engines at no
cost. Requests released at the same instant with the same deadline ``T`` after it fit
on ``m`` engines if and only if their sizes sum to at most ``m × T`` and none exceeds
``T`` (McNaughton's wrap-around rule; R. McNaughton, "Scheduling with deadlines and
loss functions", Management Science 6(1), 1959). So at most the smallest requests of
an instant that fit in that room can have TTFT ≤ ``T``, whatever came before (earlier
requests only take room away); summed over the instants, that bounds how many
requests of the trace can (:func:`on_time_bound`). The smallest ``T`` at which the
bound reaches the rank of the percentile is a lower bound on it
(:func:`percentile_bound_s`). Requests that arrive at distinct instants each form their
own instant, and the bound then falls to their prefill times alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from loadtest.sim_engine.profiles import Profile


def prefill_seconds(profile: Profile, tokens: int) -> float:
    """Seconds for one idle engine of ``profile`` to prefill ``tokens`` (≥ 1) and sample
    the first token: ``max_num_batched_tokens`` chunks, each one step of
    :meth:`Profile.step_seconds` with no decoding sequences."""
    t, left = 0.0, max(1, tokens)
    while left > 0:
        n = min(left, profile.max_num_batched_tokens)
        t += profile.step_seconds(n, 0, 0)
        left -= n
    return t


def on_time_bound(jobs: Sequence[tuple[float, float]], engines: int, t_s: float) -> int:
    """The most of ``jobs`` — ``(arrival s, prefill s)`` pairs — that any schedule on
    ``engines`` engines can start within ``t_s`` seconds of arrival (module docstring)."""
    instants: dict[float, list[float]] = defaultdict(list)
    for at, size in jobs:
        instants[at].append(size)
    n = 0
    for sizes in instants.values():
        room = engines * t_s
        for size in sorted(sizes):
            if size > t_s or size > room + 1e-9:  # slack for the rounding of room
                break
            room -= size
            n += 1
    return n


def percentile_bound_s(jobs: Sequence[tuple[float, float]], engines: int,
                       q: float = 90.0) -> float:
    """A lower bound on the ``q``-th percentile of the jobs' TTFT, s: the smallest ``T``
    with :func:`on_time_bound` ≥ the rank the percentile needs. The rank is that of
    the value numpy's (linear) percentile interpolates from below, ``⌊q/100 × (n −
    1)⌋ + 1``, so the bound also holds for the benchmark's ``ttft_p90_ms``.

    Raises:
        ValueError: no jobs, or ``engines`` < 1.
    """
    if not jobs or engines < 1:
        raise ValueError("need jobs and at least one engine")
    need = math.floor(q / 100 * (len(jobs) - 1)) + 1
    # The count only grows with T and changes where T reaches a job's size or an
    # instant's running sum over the engines.
    instants: dict[float, list[float]] = defaultdict(list)
    for at, size in jobs:
        instants[at].append(size)
    candidates = set()
    for sizes in instants.values():
        total = 0.0
        for size in sorted(sizes):
            total += size
            candidates.update((size, total / engines))
    ordered = sorted(candidates)
    lo, hi = 0, len(ordered) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if on_time_bound(jobs, engines, ordered[mid]) >= need:
            hi = mid
        else:
            lo = mid + 1
    return ordered[lo]
