"""``python -m loadtest soak --minutes 10 --load 10 --json PATH``: ``sluice serve``
held at ``--load`` × capacity for ``--minutes``.

The stand and workload are the overload benchmark's (``loadtest.overload``):
``--engines`` simulated engines (default 4, profile ``cpu-gemma3-270m-quiet``, speed 1),
the ``mixed-tenants`` workload (interactive ``acme``, standard ``globex``, batch
``initech``), open-loop Poisson arrivals, the gateway with the shipped saturation
defaults (adaptive per-engine admission, no ``max_in_flight``) and the overload
benchmark's queue (256) and per-priority queue waits. Capacity is measured first as in that benchmark:
a closed loop of ``--per-engine`` concurrent requests per engine straight to the
engines for ``--probe-s`` s (default 30, the first third a warm-up); capacity is the
rate they complete requests at (not goodput: at that batch most requests miss the
TPOT SLO, and 10 × goodput would offer less than the engines complete); or given
with ``--capacity``.

Reported: ``rss_mb_start`` (gateway RSS after a warm-up of 10 % of the run, at most
30 s: allocator arenas, connection pools and prefix index fill first) and
``rss_mb_end`` (at the end of the send window), ``rss_growth`` (end/start − 1; goal ≤
0.10), ``rss_mb_peak``; ``interactive_ttft_p99_s`` over admitted interactive requests
vs ``ttft_slo_s`` (the overload benchmark's 1 s); ``server_errors`` (5xx other than
load shedding — 503 ``overloaded``/``queue_timeout`` — and broken connections; goal
0); ``offered``, ``admitted``, ``shed`` by status:code, ``capacity_rps``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

from loadtest import overload
from loadtest.changed import changed_settings
from loadtest.harness import SHED_CODES
from loadtest.launch import gateway
from loadtest.report import write_json


def server_error(o: overload.Outcome) -> bool:
    """A 5xx other than load shedding, or a broken connection (not the client's own
    cancellation at the drain deadline)."""
    if o.status == 0:
        return o.error_code != "cancelled_at_deadline"
    return o.status >= 500 and not (o.status == 503 and o.error_code in SHED_CODES)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="sluice-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    duration = args.minutes * 60
    ov = overload.parse_args(["--json", os.devnull, "--max-output-tokens",
                              str(args.max_output_tokens)])
    engines = overload.Engines(args.engines, ov.profile, ov.speed, out_dir,
                               ["--max-model-len", "4096"])
    report: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            await engines.wait_ready(session)
            if args.capacity:
                capacity = args.capacity
            else:
                bodies = iter(overload.workload(1000.0, None, ov, seed=args.seed + 100,
                                                limit=20_000))
                probe = await overload.closed_loop(session, engines.urls, bodies,
                                                   args.per_engine, args.probe_s, args.probe_s / 3)
                print(f"probe: {probe}", file=sys.stderr, flush=True)
                capacity = probe["completed_per_s"]
            await engines.wait_idle(session)
            cfg = overload.write_gateway_config(out_dir / "config", engines.urls, ov, {})
            specs = overload.workload(args.load * capacity, duration, ov, seed=args.seed)
            with gateway(cfg, log_path=out_dir / "gateway.log", ready_timeout_s=60) as gw:
                proc = psutil.Process(gw.proc.pid)
                warmup = min(30.0, 0.1 * duration)
                t0 = time.monotonic()
                rss: list[tuple[float, float]] = []

                def sample() -> None:
                    rss.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))

                outcomes = await overload.open_loop(session, [gw.url], specs, duration,
                                                    args.drain, auth=True, sample=sample)
        finally:
            engines.stop()
    start = next(mb for t, mb in rss if t >= warmup)
    end = [mb for t, mb in rss if t <= duration][-1]
    ok = [o for o in outcomes if o.status == 200 and o.error_code is None]
    inter = [o.ttft_s for o in ok if o.priority == "interactive" and o.ttft_s is not None]
    report.update({
        "minutes": args.minutes, "load": args.load, "capacity_rps": round(capacity, 3),
        "offered": len(outcomes), "admitted": len(ok),
        "rss_mb_start": round(start, 1), "rss_mb_end": round(end, 1),
        "rss_growth": round(end / start - 1, 4), "rss_mb_peak": round(max(mb for _, mb in rss), 1),
        "interactive_ttft_p99_s": (round(float(np.percentile(inter, 99)), 3) if inter else None),
        "ttft_slo_s": overload.TTFT_SLO_S,
        "server_errors": sum(server_error(o) for o in outcomes),
        "shed": dict(sorted(Counter(f"{o.status}:{o.error_code}" for o in outcomes
                                    if o not in ok).items())),
        "config": {"engines": args.engines, "profile": ov.profile, "speed": ov.speed,
                   "saturation": "shipped defaults (adaptive admission)",
                   "max_output_tokens": args.max_output_tokens,
                   "changed": changed_settings(out_dir / "config", overload.HARNESS_REASONS)},
    })
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--minutes", type=float, default=10.0, help="send window, minutes")
    p.add_argument("--load", type=float, default=10.0, help="offered load, × capacity")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--per-engine", type=int, default=8,
                   help="probe batch per engine (the capacity probe)")
    p.add_argument("--probe-s", type=float, default=30.0, help="capacity probe, s")
    p.add_argument("--capacity", type=float, help="req/s: skip the probe")
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--drain", type=float, default=15.0, help="wait after the window, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", help="logs and config (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    write_json(args.json, asyncio.run(run(args)))
    return 0
