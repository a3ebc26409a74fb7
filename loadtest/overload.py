"""``python -m loadtest overload --json PATH``: admission control under overload.

Four simulated engines (``loadtest.sim_engine``, default profile
``cpu-gemma3-270m-quiet`` at speed 1, so simulated time is wall time and the SLO needs no
scaling) serve the ``mixed-tenants`` workload: three tenants, ``acme``
(interactive, 30 % of requests), ``globex`` (standard, 50 %), ``initech`` (batch,
20 %), each with its own shared system prompt, Poisson arrivals.

1. **Capacity.** Closed loop straight to the engines with ``b`` concurrent requests
   per engine for each ``b`` of ``--probe-batches``; goodput (requests/s finishing
   within the SLO) in the steady part of each probe. Capacity is the best goodput;
   its ``b`` is the batch the engines sustain within the SLO.
2. **Load levels.** For k = 1, 2, 3: open-loop Poisson arrivals at k × capacity for
   ``--duration`` s, once straight to the engines (round-robin over their URLs, no
   admission control: the baseline) and once through ``sluice serve`` (the gateway
   is configured with ``saturation.max_in_flight`` = the probe's ``b``).
   In-flight requests get ``--drain`` s after the window (enough for any request
   that can still meet the SLO); those still running then are cancelled and count
   as ``cancelled_at_deadline``.

SLO (DistServe's goodput, Zhong et al., OSDI 2024): a request is good if it
succeeded with TTFT ≤ 1 s and TPOT ≤ 100 ms. ``goodput`` is good requests per
second of the send window; ``slo_attainment`` per priority is good / offered
(rejections count as misses); ``shed`` counts requests that got no answer by
``status:code``; ``peak_rss_mb`` is the gateway process's peak RSS (None for the
direct baseline, which has no gateway; ``engines_peak_rss_mb`` is the engines').

``--dialects vllm vllm sglang sglang`` makes the engines speak those dialects (cycled;
the gateway reads each in its own, ``engines.kinds``): the same comparison on a mixed
fleet.

Output: ``{"1x"|"2x"|"3x": {"gateway"|"direct": {...}}, "capacity": {...},
"config": {..., "changed": {...}}}`` and per-request JSON lines under ``--out-dir``;
``config.changed`` is every setting of the gateway's config that differs from the
shipped one, with the reason (:data:`HARNESS_REASONS`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml

from engines.kinds import KINDS
from gateway.auth import hash_key
from loadtest.changed import changed_settings
from loadtest.client import send_measured, wait_healthy
from loadtest.launch import free_port, gateway
from loadtest.workloads import RequestSpec, WorkloadOptions
from loadtest.workloads.scenarios import TENANTS, mixed_tenants

MODEL = "sim-model"
PRIORITY_OF = {name: prio for name, prio, *_ in TENANTS}
KEY_OF = {name: f"overload-{name}" for name in PRIORITY_OF}
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.100


@dataclass
class Outcome:
    """One request of a run; times in s."""

    tenant: str
    priority: str
    sent_s: float
    status: int
    error_code: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_ms: float | None = None
    completion_tokens: int = 0
    engine: str | None = None
    predicted_ttft_ms: float | None = None

    @property
    def good(self) -> bool:
        return (self.status == 200 and self.error_code is None and self.ttft_s is not None
                and self.ttft_s <= TTFT_SLO_S and (self.tpot_s or 0.0) <= TPOT_SLO_S)


# ----------------------------------------------------------------------------- engines


class Engines:
    """The simulated engine processes, started by the benchmark (the gateway routes
    to them as ``external`` engines, so the same processes serve both targets).
    ``speed``: one simulator speed factor for all, or one per engine."""

    def __init__(self, n: int, profile: str, speed: float | list[float], log_dir: Path,
                 extra: list[str], dialects: list[str] | None = None) -> None:
        speeds = speed if isinstance(speed, list) else [speed] * n
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        #: each engine's dialect (``--dialects`` cycled; vLLM's by default)
        self.dialects = [(dialects or ["vllm"])[i % len(dialects or ["vllm"])]
                         for i in range(n)]
        for i in range(n):
            port = free_port()
            log = (log_dir / f"engine-{i}.log").open("wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "loadtest.sim_engine", "--port", str(port),
                 "--model", MODEL, "--profile", profile, "--speed", str(speeds[i]),
                 "--dialect", self.dialects[i], *extra],
                stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 60) -> None:
        for url in self.urls:
            await wait_healthy(session, url, timeout_s)

    async def wait_idle(self, session: aiohttp.ClientSession, timeout_s: float = 30) -> None:
        """Until no engine has requests running or waiting."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = 0.0
            for url, dialect in zip(self.urls, self.dialects, strict=True):
                kind = KINDS[dialect]
                async with session.get(url + str(kind.metrics_path)) as r:
                    snap = kind.parse(await r.text(), 0.0, None)  # type: ignore[misc]
                busy += snap.num_running + snap.num_waiting
            if busy == 0:
                return
            await asyncio.sleep(0.5)

    def rss_mb(self) -> float:
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(p.pid).memory_info().rss
        return total / 2**20

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# ----------------------------------------------------------------------------- config


#: Why :func:`write_gateway_config` changes the settings it changes from the shipped
#: ones (:func:`loadtest.changed.changed_settings` prints them in the report).
HARNESS_REASONS = {
    "gateway.cache": "off: the workload's prompts are unique, and the comparison is about "
                     "admission",
    "gateway.observability": "access log and tracing off: the simulated engines share the "
                             "2 cores with the gateway (`python -m loadtest overhead` "
                             "measures their cost)",
    "engines.supervisor.metrics_interval_s": "a run lasts 40 s: four scrapes a second give "
                                             "the load signals and the learned model four "
                                             "times the samples of the shipped 1 s",
    "engines.supervisor.probe_interval_s": "health known within a second while the harness "
                                           "starts and stops engines",
    "engines.supervisor.inference_probe_idle_s": "no inference probes mixed into the "
                                                 "measured traffic",
    "gateway.queue.max_requests": "--queue-max",
    "gateway.slo": "every band at the benchmark's SLO (TTFT 1 s, TPOT 100 ms): the "
                   "benchmark scores every request against it",
    "engines.saturation.max_in_flight": "the probe's best batch per engine (or "
                                        "--max-in-flight): the gateway under a hand-tuned "
                                        "limit, the comparison `loadtest adaptive` makes",
    "engines.saturation.interactive_reserve": "--interactive-reserve, with the tuned limit",
    "engines.saturation.adaptive.enabled": "off with the tuned limit: a static gateway",
}


def write_gateway_config(directory: Path, engine_urls: list[str], args: argparse.Namespace,
                         saturation: dict[str, Any], gateway_extra: dict[str, Any] | None = None,
                         dialects: list[str] | None = None, *, queue_waits: bool = True) -> Path:
    """gateway.yaml / engines.yaml / tenants.yaml for the run (cache off: the
    workload's prompts are unique, and the comparison is about admission), with
    ``saturation`` as engines.yaml's section and ``gateway_extra`` merged into
    gateway.yaml; ``dialects``: each engine's (default vLLM's); ``queue_waits``: the
    tenants' ``max_queue_wait_s`` from ``--interactive-wait`` etc. (False: none, the
    shipped default, where adaptive admission sheds on the SLO instead)."""
    dialects = dialects or ["vllm"] * len(engine_urls)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gateway.yaml").write_text(yaml.safe_dump({
        "cache": {"enabled": False},
        "observability": {"access_log": False, "tracing": False},
        "queue": {"max_requests": args.queue_max},
        **(gateway_extra or {}),
    }))
    (directory / "engines.yaml").write_text(yaml.safe_dump({
        # external: the benchmark starts the simulators; they tokenize as the simulator
        "engines": [{"name": f"sim-{i}", "model": MODEL, "kind": "external", "url": u,
                     "tokenizer": "fallback", "dialect": dialects[i]}
                    for i, u in enumerate(engine_urls)],
        "supervisor": {"metrics_interval_s": 0.25, "probe_interval_s": 1.0,
                       "inference_probe_idle_s": 3600},
        "saturation": saturation,
    }))
    waits = {"interactive": args.interactive_wait, "standard": args.standard_wait,
             "batch": args.batch_wait}
    (directory / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": name, "api_key_hashes": [hash_key(KEY_OF[name])], "priority": prio,
         **({"max_queue_wait_s": waits[prio]} if queue_waits else {})}
        for name, prio in PRIORITY_OF.items()]}))
    return directory


# ----------------------------------------------------------------------------- runs


async def measured(session: aiohttp.ClientSession, url: str, spec: RequestSpec, t0: float,
                   auth: bool) -> Outcome:
    headers = {"Authorization": f"Bearer {KEY_OF[spec.tenant]}"} if auth else None
    sent = time.perf_counter() - t0
    out = Outcome(spec.tenant, spec.priority, sent, status=0)
    try:
        m = await send_measured(session, url + spec.endpoint, spec.body, headers)
    except asyncio.CancelledError:
        out.error_code = "cancelled_at_deadline"
        return out
    out.status, out.error_code = m.status, m.error_code
    out.ttft_s, out.tpot_s, out.e2e_s = m.ttft_s, m.tpot_s, m.e2e_s
    out.queue_ms, out.completion_tokens = m.queue_ms, m.completion_tokens
    out.engine = m.engine
    predicted = m.headers.get("x-sluice-ttft-predicted-ms")
    out.predicted_ttft_ms = float(predicted) if predicted is not None else None
    return out


async def open_loop(session: aiohttp.ClientSession, urls: list[str], specs: list[RequestSpec],
                    duration_s: float, drain_s: float, *, auth: bool,
                    sample: Any = None) -> list[Outcome]:
    """Send ``specs`` at their times (round-robin over ``urls``) for ``duration_s``;
    cancel what still runs ``drain_s`` after the window."""
    rr = itertools.cycle(urls)
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    next_sample = 0.0
    for spec in specs:
        if spec.at_s >= duration_s:
            break
        while (now := time.perf_counter() - t0) < spec.at_s:
            if sample is not None and now >= next_sample:
                sample()
                next_sample += 0.5
            await asyncio.sleep(min(spec.at_s - now, 0.5))
        tasks.append(asyncio.create_task(measured(session, next(rr), spec, t0, auth)))
    end = t0 + duration_s + drain_s
    while (left := end - time.perf_counter()) > 0 and not all(t.done() for t in tasks):
        if sample is not None:
            sample()
        await asyncio.wait(tasks, timeout=min(left, 0.5))
    for t in tasks:
        t.cancel()
    return list(await asyncio.gather(*tasks))


async def closed_loop(session: aiohttp.ClientSession, urls: list[str], bodies: Any,
                      per_engine: int, duration_s: float, warmup_s: float) -> dict[str, Any]:
    """``per_engine`` clients per engine (started over the first half of the warm-up),
    each sending the next body as soon as its last answer ended; goodput over
    completions in [warmup, duration]."""
    t0 = time.perf_counter()
    done: list[tuple[float, Outcome]] = []

    async def client(url: str, start_s: float) -> None:
        await asyncio.sleep(start_s)  # staggered, so arrivals do not come in lockstep
        while time.perf_counter() - t0 < duration_s:
            spec = next(bodies)
            o = await measured(session, url, spec, t0, auth=False)
            done.append((time.perf_counter() - t0, o))

    stagger = warmup_s / 2 / per_engine
    tasks = [asyncio.create_task(client(u, i * stagger))
             for i in range(per_engine) for u in urls]
    await asyncio.wait(tasks, timeout=duration_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    window = [o for at, o in done if warmup_s <= at <= duration_s]
    span = duration_s - warmup_s
    return {"per_engine": per_engine, "completed_per_s": len(window) / span,
            "goodput": sum(o.good for o in window) / span,
            "slo_fraction": sum(o.good for o in window) / len(window) if window else 0.0}


class Peak:
    """Peak RSS of the gateway process and of the engines together, MB."""

    def __init__(self, gateway_proc: psutil.Process, engines: Engines) -> None:
        self._proc, self._engines = gateway_proc, engines
        self.gateway_mb = self.engines_mb = 0.0

    def sample(self) -> None:
        self.gateway_mb = max(self.gateway_mb, self._proc.memory_info().rss / 2**20)
        self.engines_mb = max(self.engines_mb, self._engines.rss_mb())


def summarize(outcomes: list[Outcome], duration_s: float, peak_rss_mb: float | None,
              engines_rss_mb: float) -> dict[str, Any]:
    by_prio: dict[str, list[Outcome]] = {p: [] for p in ("interactive", "standard", "batch")}
    for o in outcomes:
        by_prio[o.priority].append(o)
    shed = Counter(f"{o.status}:{o.error_code}" for o in outcomes
                   if o.status != 200 or o.error_code is not None)
    ok = [o for o in outcomes if o.status == 200 and o.error_code is None]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    tpots = sorted(o.tpot_s for o in ok if o.tpot_s is not None)

    def p(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {
        "goodput": sum(o.good for o in outcomes) / duration_s,
        "slo_attainment": {k: (sum(o.good for o in v) / len(v) if v else None)
                           for k, v in by_prio.items()},
        "shed": dict(sorted(shed.items())),
        "peak_rss_mb": peak_rss_mb,
        "engines_peak_rss_mb": engines_rss_mb,
        "offered": len(outcomes), "served": len(ok),
        "ttft_s": {"p50": p(ttfts, 0.5), "p99": p(ttfts, 0.99)},
        "tpot_s": {"p50": p(tpots, 0.5), "p99": p(tpots, 0.99)},
    }


def workload(rate: float, duration_s: float | None, args: argparse.Namespace, seed: int,
             limit: int | None = None) -> list[RequestSpec]:
    opts = WorkloadOptions(model=MODEL, rate=rate, duration_s=duration_s, seed=seed,
                           limit=limit, max_output_tokens=args.max_output_tokens)
    return mixed_tenants(opts).requests


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--max-model-len", "4096"]
    engines = Engines(args.engines, args.profile, args.speed, out_dir, extra, args.dialects)
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        try:
            await engines.wait_ready(session)
            # warm each engine's prefix cache with every tenant's system prompt
            warm = workload(10.0, 10.0, args, seed=999)
            firsts = {s.tenant: s for s in reversed(warm)}.values()
            await asyncio.gather(*(measured(session, u, s, time.perf_counter(), auth=False)
                                   for u in engines.urls for s in firsts))
            bodies = iter(workload(1000.0, None, args, seed=args.seed + 100, limit=20_000))
            probes = []
            for b in [] if args.capacity else args.probe_batches:
                await engines.wait_idle(session)
                probes.append(await closed_loop(session, engines.urls, bodies, b,
                                                args.probe_duration, args.probe_warmup))
                print(f"probe b={b}: {probes[-1]}", file=sys.stderr, flush=True)
            best = max(probes, key=lambda r: r["goodput"]) if probes else {
                "goodput": args.capacity, "per_engine": args.max_in_flight}
            capacity = best["goodput"]
            max_in_flight = args.max_in_flight or best["per_engine"]
            report["capacity"] = {"requests_per_s": capacity, "per_engine": best["per_engine"],
                                  "probes": probes, "max_in_flight": max_in_flight}
            cfg_dir = write_gateway_config(
                out_dir / "config", engines.urls, args,
                {"max_in_flight": max_in_flight, "interactive_reserve": args.interactive_reserve},
                dialects=engines.dialects)
            report["config"]["changed"] = changed_settings(cfg_dir, HARNESS_REASONS)
            with gateway(cfg_dir, log_path=out_dir / "gateway.log", ready_timeout_s=60) as gw:
                gproc = psutil.Process(gw.proc.pid)
                for k in args.levels:
                    level: dict[str, Any] = {}
                    specs = workload(k * capacity, args.duration, args, seed=args.seed + k)
                    for target in args.targets:
                        await engines.wait_idle(session)
                        peak = Peak(gproc, engines)
                        urls = [gw.url] if target == "gateway" else engines.urls
                        outcomes = await open_loop(session, urls, specs, args.duration,
                                                   args.drain, auth=target == "gateway",
                                                   sample=peak.sample)
                        level[target] = summarize(
                            outcomes, args.duration,
                            peak.gateway_mb if target == "gateway" else None, peak.engines_mb)
                        with (out_dir / f"{k}x-{target}.jsonl").open("w") as f:
                            for o in outcomes:
                                f.write(json.dumps(asdict(o)) + "\n")
                        print(f"{k}x {target}: {json.dumps(level[target])}", file=sys.stderr,
                              flush=True)
                    report[f"{k}x"] = level
        finally:
            engines.stop()
    return report


def format_table(report: dict[str, Any]) -> str:
    cap = report["capacity"]
    lines = [f"capacity: {cap['requests_per_s']:.2f} req/s within SLO at "
             f"{cap['per_engine']} concurrent per engine (gateway max_in_flight "
             f"{cap['max_in_flight']})",
             f"{'load':5} {'target':8} {'goodput':>8} {'inter':>6} {'std':>6} {'batch':>6} "
             f"{'rss MB':>7}  shed"]
    for k in ("1x", "2x", "3x"):
        for target in ("direct", "gateway"):
            r = report.get(k, {}).get(target)
            if r is None:
                continue
            a = r["slo_attainment"]
            f = lambda v: "-" if v is None else f"{v:6.1%}"  # noqa: E731
            rss = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:7.0f}"
            lines.append(f"{k:5} {target:8} {r['goodput']:8.2f} {f(a['interactive'])} "
                         f"{f(a['standard'])} {f(a['batch'])} {rss:>7}  {r['shed']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest overload",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--out-dir", default="out/overload", help="logs, config, per-request lines")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--dialects", nargs="+", default=["vllm"],
                   choices=sorted(k for k, kind in KINDS.items() if kind.metrics_path),
                   help="the engines' dialects, cycled (e.g. vllm vllm sglang sglang: a mixed "
                   "fleet); default all vllm")
    p.add_argument("--profile", default="cpu-gemma3-270m-quiet")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=40.0, help="send window per run, s")
    p.add_argument("--drain", type=float, default=15.0,
                   help="wait after the window, s (≥ 1 + 100 ms × max output tokens)")
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--probe-batches", type=int, nargs="+", default=[4, 6, 8, 10])
    p.add_argument("--probe-duration", type=float, default=30.0)
    p.add_argument("--probe-warmup", type=float, default=10.0)
    p.add_argument("--max-in-flight", type=int, help="default: the probe's best batch")
    p.add_argument("--interactive-reserve", type=int, default=3,
                   help="saturation.interactive_reserve: in-flight slots per engine "
                   "only interactive requests may take")
    p.add_argument("--queue-max", type=int, default=256)
    p.add_argument("--interactive-wait", type=float, default=0.7,
                   help="max_queue_wait_s of the interactive tenant, s: the TTFT SLO "
                   "(1 s) less a typical prefill (~0.3 s); a ticket that waited longer "
                   "misses the SLO anyway, and serving it would hold a slot for a whole "
                   "generation and push later tickets past theirs (2.0 before: 78 %% → "
                   "85-88 %% interactive SLO attainment at 3x)")
    p.add_argument("--standard-wait", type=float, default=0.5)
    p.add_argument("--batch-wait", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=float,
                   help="req/s: skip the probes and take this capacity (with --max-in-flight)")
    p.add_argument("--targets", nargs="+", choices=("direct", "gateway"),
                   default=["direct", "gateway"])
    p.add_argument("--quick", action="store_true",
                   help="iteration run (~2 min): --capacity 2.95 --max-in-flight 8 "
                   "--levels 3 --targets gateway unless given; not the benchmark")
    args = p.parse_args(argv)
    if args.quick:
        args.capacity = args.capacity or 2.95
        args.max_in_flight = args.max_in_flight or 8
        if args.levels == [1, 2, 3]:
            args.levels = [3]
        if args.targets == ["direct", "gateway"]:
            args.targets = ["gateway"]
    if args.capacity and not args.max_in_flight:
        p.error("--capacity needs --max-in-flight")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0
