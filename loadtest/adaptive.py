"""``python -m loadtest adaptive --json PATH``: the learned per-engine admission
against the best static concurrency limit, on simulated engines.

Harness, workload, SLO and summaries are :mod:`loadtest.overload`'s (``mixed-tenants``:
interactive 30 %, standard 50 %, batch 20 %; a request is good with TTFT ≤ 1 s and
TPOT ≤ 100 ms; rejections count as misses).

1. **homogeneous** — 4 engines at speed 1. The closed-loop probe finds the capacity
   and the best static ``max_in_flight`` ``b`` (``--capacity`` and ``--per-engine``
   give them instead, so that two code versions can be compared at the same load:
   the probe's answer varies by about 15 % from run to run). Then through the gateway with the
   shipped saturation defaults (adaptive, no ``max_in_flight``): ``adaptive_1x``,
   ``adaptive_2x``, ``adaptive`` (3×); straight to the engines ``direct_1x``; through
   a gateway with ``max_in_flight = b`` (adaptive off, ``interactive_reserve`` as the
   overload benchmark): ``static_tuned`` (3×, the same arrivals).
   ``oracle_interactive_3x``: the 3× run's interactive arrivals replayed through an
   ideal FCFS scheduler serving interactive requests only on ``engines × b`` slots,
   each with its measured service time (TTFT + TPOT × (tokens − 1) where a run served
   it, else the median of those); the fraction that starts within the TTFT SLO. It
   bounds policies that hold each engine to ``b`` requests; learned knees above ``b``
   (an engine whose interactive requests' TPOT allows more) can beat it.
   Each of these runs is made ``--repeat`` times (default 3), each time on new
   arrivals (seed ``--seed + k + 10 r`` for repeat ``r`` at ``k`` × capacity), and
   the figures pool them: goodput over the repeats' total window, attainment over all
   their requests, the oracle over all their interactive arrivals; ``runs`` keeps
   each repeat's goodput. One 40 s run at 1× holds about 110 requests and moves by a
   few of them with the arrivals alone, too few to tell a 2 % goal from noise
   (``docs/results.md``, "python -m loadtest adaptive").
2. **heterogeneous** — 4 engines at speeds ``--het-speeds`` (0.5 1 1 2); the probe
   (``b`` clients per engine, the same ``b`` for all) gives the best single static
   limit; ``adaptive`` and ``static_tuned`` at 3× that capacity.
3. **shift** — a fresh adaptive gateway (no warm-up: learning is what this
   measures) on the homogeneous engines at ``--shift-load`` × capacity; the prompts
   switch from short (user turn 20–100 tokens, 16–64 output) to long (300–700,
   64–128: a prefill the engine can still start within the 1 s TTFT target when
   nothing is queued) and back every ``--shift-phase`` s. The mean learned limit
   (``sluice_engine_concurrency_limit``) is sampled every 0.5 s;
   ``convergence_s`` is the longest time, after a switch, until both the limit stays
   within 25 % (at least ±1) of its value over the last 40 % of the phase and the
   interactive attainment of 5 s windows (each in the phase it starts in) stays within
   0.1 of the phase's last 40 %, or within two binomial standard errors of a window at
   that attainment where larger (:func:`attainment_tolerance`: a fixed 0.1 judged
   arrival noise, not settling, once the phase's attainment is below about 0.9);
   ``worst_window_attainment`` is the lowest interactive attainment of 10 s windows.
   Made ``--repeat`` times too (seed ``--seed + 50 + 10 r``, a fresh gateway each),
   judged on the repeats together: the limit averaged across them in 1 s bins, a
   window's attainment over all their interactive requests in it (one 5 s window
   of one run holds about 8 of them, so one arrival burst moves it by more than the
   0.1 tolerance); ``runs`` keeps each repeat's own figures. Each repeat's limit and
   fitted-parameter samples go to ``shift[-rN]-limits.jsonl`` in ``--out-dir``.
4. **prediction** — ``|TTFT̂ − TTFT| / TTFT`` over the adaptive runs' served
   streamed requests, with TTFT̂ from ``x-sluice-ttft-predicted-ms`` and TTFT
   measured by the client less the gateway queue wait (``x-sluice-queue-ms``).

Each gateway run's summary has ``shed_reasons``: the gateway's rejections by
``band:reason`` (its ``sluice_rejected_total``), e.g.
``interactive:overloaded:predicted_miss``.

Each fresh adaptive gateway first serves ``--warmup-s`` of unmeasured 1× traffic: the
benchmark measures a gateway that has learned its engines, as a deployed one has (the
learning itself is what ``shift`` measures).

Settings that differ from the shipped defaults, printed in the report's
``config.changed`` with the reason: each setting of the adaptive gateways' config files
that differs from the shipped one (:func:`loadtest.changed.changed_settings`, reasons
in :data:`loadtest.overload.HARNESS_REASONS`: among them ``gateway.slo``, every band
at the benchmark's SLO of 1 s and 100 ms, which scores every request, and the
supervisor's quarter-second metrics scrapes); engines report
``prompt_tokens_details`` (``--enable-prompt-tokens-details``, as a vLLM deployment
would be run) so the model sees cached tokens; the static gateway's
``max_in_flight``/``interactive_reserve``/``adaptive.enabled: false`` and its tenants'
``max_queue_wait_s`` (``--interactive-wait`` etc., hand-tuned for it; it is the
comparison, not the product). The adaptive gateways' tenants set no
``max_queue_wait_s`` (the shipped default): their queue deadline is the band's TTFT
target (``predicted_miss``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.changed import changed_settings
from loadtest.launch import gateway
from loadtest.overload import (
    HARNESS_REASONS,
    MODEL,
    PRIORITY_OF,
    TPOT_SLO_S,
    TTFT_SLO_S,
    Engines,
    Outcome,
    closed_loop,
    measured,
    open_loop,
    summarize,
    workload,
    write_gateway_config,
)
from loadtest.workloads import RequestSpec, WorkloadOptions
from loadtest.workloads.base import poisson_times, synthetic_text
from loadtest.workloads.scenarios import TENANTS

BENCH_SLO = {band: {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S}
             for band in ("interactive", "standard", "batch")}
ENGINE_EXTRA = ["--max-model-len", "4096", "--enable-prompt-tokens-details"]


def adaptive_config(directory: Path, engine_urls: list[str], args: argparse.Namespace,
                    report: dict[str, Any]) -> Path:
    """The adaptive gateway's config folder: the shipped saturation section, every band
    at the benchmark's SLO, tenants without queue waits; what it changes from the
    shipped config goes to ``report["config"]["changed"]``
    (:func:`loadtest.changed.changed_settings`)."""
    cfg = write_gateway_config(directory, engine_urls, args, {}, {"slo": BENCH_SLO},
                               queue_waits=False)
    report["config"]["changed"].update(changed_settings(cfg, HARNESS_REASONS))
    return cfg


def _static_cfg(b: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"max_in_flight": b, "interactive_reserve": min(args.interactive_reserve, b - 1),
            "adaptive": {"enabled": False}}


# ----------------------------------------------------------------------------- pieces


class LimitSampler:
    """Scrapes the gateway's ``sluice_engine_concurrency_limit`` and
    ``sluice_engine_latency_param`` every 0.5 s."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.samples: list[tuple[float, dict[str, float]]] = []
        #: (s, engine -> its ``sluice_engine_latency_param`` values), with each sample
        self.params: list[tuple[float, dict[str, dict[str, float]]]] = []
        self._task: asyncio.Task[None] | None = None
        self.t0 = 0.0

    async def _run(self) -> None:
        while True:
            try:
                async with self.session.get(self.url + "/metrics") as r:
                    text = await r.text()
                limits: dict[str, float] = {}
                params: dict[str, dict[str, float]] = {}
                for line in text.splitlines():
                    if line.startswith("sluice_engine_concurrency_limit{"):
                        engine = line.split('engine="', 1)[1].split('"', 1)[0]
                        limits[engine] = float(line.rsplit(" ", 1)[1])
                    elif line.startswith("sluice_engine_latency_param{"):
                        engine = line.split('engine="', 1)[1].split('"', 1)[0]
                        name = line.split('param="', 1)[1].split('"', 1)[0]
                        params.setdefault(engine, {})[name] = float(line.rsplit(" ", 1)[1])
                t = time.perf_counter() - self.t0
                self.samples.append((t, limits))
                self.params.append((t, params))
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def probe(session: aiohttp.ClientSession, engines: Engines, args: argparse.Namespace,
                seed: int) -> dict[str, Any]:
    """Closed-loop probe over ``--probe-batches``: the best goodput and its batch."""
    bodies = iter(workload(1000.0, None, args, seed=seed, limit=20_000))
    probes = []
    for b in args.probe_batches:
        await engines.wait_idle(session)
        probes.append(await closed_loop(session, engines.urls, bodies, b,
                                        args.probe_duration, args.probe_warmup))
        print(f"probe b={b}: {probes[-1]}", file=sys.stderr, flush=True)
    best = max(probes, key=lambda r: r["goodput"])
    if best["goodput"] <= 0:
        raise RuntimeError(f"no probe finished a request within the SLO: {probes} (a probe "
                           "shorter than one generation, or an overloaded machine)")
    return {"requests_per_s": best["goodput"], "per_engine": best["per_engine"],
            "probes": probes}


async def warm(session: aiohttp.ClientSession, engines: Engines, args: argparse.Namespace) -> None:
    """Every tenant's system prompt into every engine's prefix cache."""
    first = {s.tenant: s for s in reversed(workload(10.0, 10.0, args, seed=999))}.values()
    await asyncio.gather(*(measured(session, u, s, time.perf_counter(), auth=False)
                           for u in engines.urls for s in first))


async def rejections(session: aiohttp.ClientSession, gateway_url: str) -> Counter[str]:
    """The gateway's ``sluice_rejected_total`` as ``"band:reason"`` counts (the
    benchmark's tenants each have one band)."""
    async with session.get(gateway_url + "/metrics") as r:
        text = await r.text()
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if sample.name == "sluice_rejected_total" and tenant in PRIORITY_OF:
                out[f"{PRIORITY_OF[tenant]}:{sample.labels['reason']}"] += int(sample.value)
    return out


async def level(session: aiohttp.ClientSession, engines: Engines, urls: list[str],
                specs: list[RequestSpec], args: argparse.Namespace, *, auth: bool,
                name: str, out_dir: Path, duration_s: float | None = None,
                reasons: dict[str, Any] | None = None) -> list[Outcome]:
    """One open-loop run of ``specs``; its outcomes also go to ``name.jsonl``. With
    ``reasons`` (a gateway run), ``reasons[name]`` gets the run's rejections by band
    and reason (:func:`rejections`)."""
    await engines.wait_idle(session)
    duration_s = duration_s or args.duration
    before = await rejections(session, urls[0]) if reasons is not None else None
    outcomes = await open_loop(session, urls, specs, duration_s, args.drain, auth=auth)
    if reasons is not None and before is not None:
        reasons[name] = dict(sorted((await rejections(session, urls[0]) - before).items()))
    with (out_dir / f"{name}.jsonl").open("w") as f:
        for o in outcomes:
            f.write(json.dumps(asdict(o)) + "\n")
    return outcomes


def summary(outcomes: list[Outcome], duration_s: float,
            reasons: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's figures (:func:`loadtest.overload.summarize`); ``shed_reasons``: the
    gateway's rejections by ``band:reason`` when given."""
    s = summarize(outcomes, duration_s, None, 0.0)
    out = {k: s[k] for k in ("goodput", "slo_attainment", "shed", "offered", "served",
                             "ttft_s", "tpot_s")}
    if reasons is not None:
        out["shed_reasons"] = reasons
    return out


def oracle_interactive(specs: list[RequestSpec], runs: list[list[Outcome]], duration_s: float,
                       slots: int) -> tuple[int, int] | None:
    """The ideal interactive-only FCFS scheduler (module docstring) on one run's
    arrivals: (interactive requests it starts within the TTFT SLO, interactive
    requests), None when there are none or no run served one; ``runs`` are outcome
    lists in ``specs`` order."""
    inter = [i for i, s in enumerate(specs) if s.at_s < duration_s and s.priority == "interactive"]
    if not inter:
        return None
    service: dict[int, tuple[float, float]] = {}
    for outcomes in runs:
        for i in inter:
            o = outcomes[i] if i < len(outcomes) else None
            if i not in service and o is not None and o.status == 200 and o.error_code is None \
                    and o.ttft_s is not None:
                ttft = o.ttft_s - (o.queue_ms or 0) / 1000
                service[i] = (ttft, ttft + (o.tpot_s or 0.0) * max(0, o.completion_tokens - 1))
    if not service:
        return None
    fallback = (statistics.median(v[0] for v in service.values()),
                statistics.median(v[1] for v in service.values()))
    free = [0.0] * slots  # heap of slot free times
    good = 0
    for i in inter:
        ttft, total = service.get(i, fallback)
        start = max(specs[i].at_s, heapq.heappop(free))
        heapq.heappush(free, start + total)
        good += (start - specs[i].at_s + ttft) <= TTFT_SLO_S
    return good, len(inter)


def rel_errors(outcomes: list[Outcome]) -> list[float]:
    out = []
    for o in outcomes:
        if o.predicted_ttft_ms is None or o.ttft_s is None or o.status != 200 or o.error_code:
            continue
        actual = o.ttft_s - (o.queue_ms or 0.0) / 1000
        if actual > 0:
            out.append(abs(o.predicted_ttft_ms / 1000 - actual) / actual)
    return out


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


# ----------------------------------------------------------------------------- setups


async def homogeneous(session: aiohttp.ClientSession, args: argparse.Namespace,
                      out_dir: Path, report: dict[str, Any]) -> tuple[list[Outcome], float]:
    engines = Engines(args.engines, args.profile, args.speed, out_dir, ENGINE_EXTRA)
    res: dict[str, Any] = {}
    runs: dict[str, list[list[Outcome]]] = {}  # run key -> outcomes of each repeat
    reasons: dict[str, Any] = {}
    try:
        await engines.wait_ready(session)
        await warm(session, engines, args)
        cap = await probe(session, engines, args, args.seed + 100) if args.capacity is None \
            else {"requests_per_s": args.capacity, "per_engine": args.per_engine,
                  "given": True}
        res["capacity"] = cap
        capacity, b = cap["requests_per_s"], cap["per_engine"]
        specs = {(k, r): workload(k * capacity, args.duration, args, seed=repeat_seed(args, k, r))
                 for k in (1, 2, 3) for r in range(args.repeat)}

        async def measure(key: str, k: int, urls: list[str], gateway_run: bool) -> None:
            names = [f"homogeneous-{key}" + (f"-r{r}" if r else "") for r in range(args.repeat)]
            runs[key] = [await level(session, engines, urls, specs[k, r], args,
                                     auth=gateway_run, name=name, out_dir=out_dir,
                                     reasons=reasons if gateway_run else None)
                         for r, name in enumerate(names)]
            res[key] = pooled(runs[key], args.duration,
                              [reasons[n] for n in names] if gateway_run else None)
            print(f"homogeneous {key}: {json.dumps(res[key])}", file=sys.stderr, flush=True)

        cfg = adaptive_config(out_dir / "homogeneous-adaptive", engines.urls, args, report)
        with gateway(cfg, log_path=out_dir / "homogeneous-adaptive.log", ready_timeout_s=60) as gw:
            # one unmeasured 1x pass first, as a running gateway would have seen traffic
            await level(session, engines, [gw.url],
                        workload(capacity, args.warmup_s, args, seed=args.seed + 4), args,
                        auth=True, name="homogeneous-learn", out_dir=out_dir,
                        duration_s=args.warmup_s)
            for k, key in ((1, "adaptive_1x"), (2, "adaptive_2x"), (3, "adaptive")):
                await measure(key, k, [gw.url], True)
        await measure("direct_1x", 1, engines.urls, False)
        cfg = write_gateway_config(out_dir / "homogeneous-static", engines.urls, args,
                                   _static_cfg(b, args), {"slo": BENCH_SLO})
        with gateway(cfg, log_path=out_dir / "homogeneous-static.log", ready_timeout_s=60) as gw:
            await measure("static_tuned", 3, [gw.url], True)
        res["static_tuned"]["max_in_flight"] = b
        good = total = 0
        for r in range(args.repeat):
            counts = oracle_interactive(specs[3, r], [runs["static_tuned"][r], runs["adaptive"][r]],
                                        args.duration, args.engines * b)
            if counts is not None:
                good, total = good + counts[0], total + counts[1]
        res["oracle_interactive_3x"] = good / total if total else None
        report["homogeneous"] = res
        return [o for key in ("adaptive_1x", "adaptive_2x", "adaptive")
                for outs in runs[key] for o in outs], capacity
    finally:
        engines.stop()


def repeat_seed(args: argparse.Namespace, k: int, r: int) -> int:
    """The arrival seed of repeat ``r`` (0-based) of a repeated run: ``--seed + k`` for
    the first (as before ``--repeat``), 10 more per repeat; ``k`` is the homogeneous
    runs' load (× capacity), 50 for the shift run."""
    return args.seed + k + 10 * r


def pooled(repeats: list[list[Outcome]], duration_s: float,
           reasons: list[dict[str, int]] | None = None) -> dict[str, Any]:
    """:func:`summary` of ``repeats`` (each one run's outcomes, over ``duration_s``)
    taken together (goodput over ``len(repeats) × duration_s``, attainment over every
    request), with ``runs``: each repeat's own goodput, req/s."""
    merged: Counter[str] = Counter()
    for r in reasons or ():
        merged.update(r)
    out = summary([o for outs in repeats for o in outs], duration_s * len(repeats),
                  None if reasons is None else dict(sorted(merged.items())))
    out["runs"] = [round(summary(outs, duration_s)["goodput"], 3) for outs in repeats]
    return out


async def heterogeneous(session: aiohttp.ClientSession, args: argparse.Namespace,
                        out_dir: Path, report: dict[str, Any]) -> list[Outcome]:
    n = len(args.het_speeds)
    engines = Engines(n, args.profile, list(args.het_speeds), out_dir, ENGINE_EXTRA)
    res: dict[str, Any] = {"speeds": list(args.het_speeds)}
    reasons: dict[str, Any] = {}
    try:
        await engines.wait_ready(session)
        await warm(session, engines, args)
        cap = await probe(session, engines, args, args.seed + 200)
        res["capacity"] = cap
        capacity, b = cap["requests_per_s"], cap["per_engine"]
        specs = workload(3 * capacity, args.duration, args, seed=args.seed + 33)
        gw_extra = {"slo": BENCH_SLO}
        cfg = adaptive_config(out_dir / "heterogeneous-adaptive", engines.urls, args, report)
        with gateway(cfg, log_path=out_dir / "heterogeneous-adaptive.log",
                     ready_timeout_s=60) as gw:
            # one 1x pass first, as a running gateway would have seen traffic before
            await level(session, engines, [gw.url],
                        workload(capacity, args.warmup_s, args, seed=args.seed + 34), args,
                        auth=True, name="heterogeneous-learn", out_dir=out_dir,
                        duration_s=args.warmup_s)
            sampler = LimitSampler(session, gw.url)
            sampler.start()
            adaptive = await level(session, engines, [gw.url], specs, args, auth=True,
                                   name="heterogeneous-adaptive", out_dir=out_dir,
                                   reasons=reasons)
            await sampler.stop()
        res["adaptive"] = summary(adaptive, args.duration, reasons["heterogeneous-adaptive"])
        last = sampler.samples[-len(sampler.samples) // 3:] if sampler.samples else []
        res["adaptive"]["learned_limits"] = {
            e: round(statistics.mean(s[1].get(e, 0.0) for s in last), 1)
            for e in (last[-1][1] if last else {})}
        cfg = write_gateway_config(out_dir / "heterogeneous-static", engines.urls, args,
                                   _static_cfg(b, args), gw_extra)
        with gateway(cfg, log_path=out_dir / "heterogeneous-static.log", ready_timeout_s=60) as gw:
            static = await level(session, engines, [gw.url], specs, args, auth=True,
                                 name="heterogeneous-static_tuned", out_dir=out_dir,
                                 reasons=reasons)
        res["static_tuned"] = summary(static, args.duration,
                                      reasons["heterogeneous-static_tuned"])
        res["static_tuned"]["max_in_flight"] = b
        report["heterogeneous"] = res
        return adaptive
    finally:
        engines.stop()


def shift_workload(rate: float, phase_s: float, seed: int, max_output: int) -> list[RequestSpec]:
    """mixed-tenants arrivals whose user turns switch short → long → short each
    ``phase_s`` seconds (see the module docstring)."""
    rng = random.Random(seed)
    opts = WorkloadOptions(model=MODEL, rate=rate, seed=seed, max_output_tokens=max_output)
    specs = []
    for i, t in enumerate(poisson_times(int(3 * phase_s * rate) + 1, rate, rng)):
        name, prio, slot, _, sys_tokens = rng.choices(TENANTS, [x[3] for x in TENANTS])[0]
        long_phase = phase_s <= t < 2 * phase_s
        user = rng.randint(300, 700) if long_phase else rng.randint(20, 100)
        out = rng.randint(64, 128) if long_phase else rng.randint(16, 64)
        messages = [
            {"role": "system", "content": synthetic_text(f"tenant/{name}/system", sys_tokens)},
            {"role": "user", "content": synthetic_text(f"shift/{seed}/{i}", user)}]
        specs.append(RequestSpec(t, name, prio, opts.body(messages, opts.output_tokens(out)),
                                 api_key_slot=slot))
    return [s for s in specs if s.at_s < 3 * phase_s]


def settle_time(series: list[tuple[float, float, int]], start: float, end: float,
                tol: Callable[[float, int], float], width: float = 0.0) -> float | None:
    """Seconds after ``start`` from which ``series`` (t, value, n: the samples behind
    the value) stays within ``tol(final, n)`` of ``final``, its median over the points
    in the last 40 % of [start, end); a point at ``t`` covers [t, t + ``width``), so a
    deviating one is settled from at its end."""
    window = [(t, v, n) for t, v, n in series if start <= t < end]
    tail = [v for t, v, _ in window if t >= end - 0.4 * (end - start)]
    if not tail:
        return None
    final = statistics.median(tail)
    settled = start
    for t, v, n in window:
        if abs(v - final) > tol(final, n):
            settled = t + width
    return round(settled - start, 1)


def attainment_tolerance(final: float, n: int) -> float:
    """How far a window's attainment (fraction 0–1 of ``n`` requests) may be from the
    phase's ``final`` and count as settled: 0.1, or two binomial standard errors
    ``2 √(f (1 − f) / n)`` where larger (a window of 27 requests at f = 0.85 moves by
    0.14 at 2σ with the arrivals alone)."""
    return max(0.1, 2 * math.sqrt(final * (1 - final) / n))


async def shift(session: aiohttp.ClientSession, args: argparse.Namespace, out_dir: Path,
                report: dict[str, Any], capacity: float) -> None:
    engines = Engines(args.engines, args.profile, args.speed, out_dir, ENGINE_EXTRA)
    phase = args.shift_phase
    limit_runs: list[list[tuple[float, float]]] = []
    outcome_runs: list[list[Outcome]] = []
    try:
        await engines.wait_ready(session)
        await warm(session, engines, args)
        for r in range(args.repeat):
            name = "shift" + (f"-r{r}" if r else "")
            specs = shift_workload(args.shift_load * capacity, phase, repeat_seed(args, 50, r),
                                   args.max_output_tokens)
            cfg = adaptive_config(out_dir / name, engines.urls, args, report)
            with gateway(cfg, log_path=out_dir / f"{name}.log", ready_timeout_s=60) as gw:
                sampler = LimitSampler(session, gw.url)
                sampler.start()
                outcome_runs.append(await level(session, engines, [gw.url], specs, args,
                                                auth=True, name=name, out_dir=out_dir,
                                                duration_s=3 * phase))
                await sampler.stop()
            with open(out_dir / f"{name}-limits.jsonl", "w") as f:
                for (t, v), (_, params) in zip(sampler.samples, sampler.params, strict=True):
                    f.write(json.dumps({"t_s": round(t, 2), "limits": v, "params": params}) + "\n")
            limit_runs.append([(t, statistics.mean(v.values())) for t, v in sampler.samples if v])
            settling = shift_settling(limit_runs[-1:], outcome_runs[-1:], phase)
            print(f"shift repeat {r}: {json.dumps(settling)}", file=sys.stderr, flush=True)
    finally:
        engines.stop()
    report["shift"] = shift_figures(limit_runs, outcome_runs, phase)


def shift_settling(limit_runs: list[list[tuple[float, float]]],
                   outcome_runs: list[list[Outcome]], phase_s: float) -> dict[str, Any]:
    """The shift run's settling figures over repeats taken together: the mean learned
    limit (``limit_runs``: per repeat, (s since start, limit) samples) averaged across
    repeats in 1 s bins; interactive attainment of a window = good / requests over
    every repeat's interactive requests sent in it (``outcome_runs``), at least 3.
    ``convergence_by_switch_s`` (s, per switch; module docstring, item 3),
    ``convergence_s`` (their maximum), ``worst_window_attainment`` (fraction 0–1, 10 s
    windows, None without one) and ``limit_by_phase`` (mean limit per phase)."""
    bins: dict[int, list[float]] = {}
    for series in limit_runs:
        for t, v in series:
            bins.setdefault(int(t), []).append(v)
    limits = [(float(b), statistics.mean(vs)) for b, vs in sorted(bins.items())]
    inter = [o for outs in outcome_runs for o in outs if o.priority == "interactive"]

    def attainment(lo: float, hi: float) -> tuple[float, int] | None:
        xs = [o for o in inter if lo <= o.sent_s < hi]
        return (sum(o.good for o in xs) / len(xs), len(xs)) if len(xs) >= 3 else None

    end = int(3 * phase_s)
    windows5 = [(t, *a) for t in range(0, end, 5) if (a := attainment(t, t + 5)) is not None]
    conv = []
    for k in (1, 2):  # the two switches
        lo, hi = k * phase_s, (k + 1) * phase_s
        a = settle_time([(t, v, 1) for t, v in limits], lo, hi,
                        lambda f, _: max(1.0, 0.25 * f))
        b = settle_time(windows5, lo, hi, attainment_tolerance, width=5.0)
        conv.append(max(x for x in (a, b, 0.0) if x is not None))
    worst = [a[0] for t in range(0, end, 10) if (a := attainment(t, t + 10)) is not None]
    by_phase = [[v for t, v in limits if k * phase_s <= t < (k + 1) * phase_s] for k in range(3)]
    return {"convergence_s": max(conv), "convergence_by_switch_s": conv,
            "worst_window_attainment": min(worst) if worst else None,
            "limit_by_phase": [round(statistics.mean(v), 1) if v else None for v in by_phase]}


def shift_figures(limit_runs: list[list[tuple[float, float]]],
                  outcome_runs: list[list[Outcome]], phase_s: float) -> dict[str, Any]:
    """``report["shift"]``: :func:`shift_settling` over all repeats, ``summary``
    (:func:`pooled` over the 3 phases) and ``runs``: each repeat's own
    ``convergence_s`` and ``worst_window_attainment``."""
    out = shift_settling(limit_runs, outcome_runs, phase_s)
    out["summary"] = pooled(outcome_runs, 3 * phase_s)
    out["runs"] = [{k: s[k] for k in ("convergence_s", "worst_window_attainment")}
                   for s in (shift_settling([lim], [outs], phase_s)
                             for lim, outs in zip(limit_runs, outcome_runs, strict=True))]
    return out


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, each ``{"value", "goal", "met"}``."""
    out: dict[str, Any] = {}

    def check(name: str, value: float | None, goal: float, *, at_most: bool = False) -> None:
        met = None if value is None else (value <= goal if at_most else value >= goal)
        out[name] = {"value": None if value is None else round(value, 3), "goal": goal, "met": met}

    h = report.get("homogeneous")
    if h:
        check("adaptive_1x / direct_1x goodput", h["adaptive_1x"]["goodput"]
              / max(h["direct_1x"]["goodput"], 1e-9), 0.98)
        check("homogeneous adaptive / static_tuned goodput", h["adaptive"]["goodput"]
              / max(h["static_tuned"]["goodput"], 1e-9), 0.95)
        check("interactive attainment at 2x", h["adaptive_2x"]["slo_attainment"]["interactive"],
              0.99)
        oracle = h.get("oracle_interactive_3x")
        if oracle:
            check("interactive attainment at 3x / oracle",
                  h["adaptive"]["slo_attainment"]["interactive"] / oracle, 0.98)
        check("3x goodput / 1x capacity", h["adaptive"]["goodput"]
              / max(h["capacity"]["requests_per_s"], 1e-9), 0.9)
    het = report.get("heterogeneous")
    if het:
        check("heterogeneous adaptive / static_tuned goodput", het["adaptive"]["goodput"]
              / max(het["static_tuned"]["goodput"], 1e-9), 0.95)
    sh = report.get("shift")
    if sh:
        check("shift convergence_s", sh["convergence_s"], 30.0, at_most=True)
    p = report.get("prediction")
    if p:
        check("ttft_rel_err_p50", p["ttft_rel_err_p50"], 0.2, at_most=True)
        check("ttft_rel_err_p90", p["ttft_rel_err_p90"], 0.5, at_most=True)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": {
        **{k: v for k, v in vars(args).items() if k != "json"},
        "changed": {  # and the adaptive gateways' config files' (adaptive_config)
            "engines --enable-prompt-tokens-details": "usage reports cached tokens, as a "
                                                      "vLLM deployment would be run",
            "static_tuned": "max_in_flight = the probe's best batch, interactive_reserve, "
                            "adaptive.enabled false, the tenants' max_queue_wait_s "
                            "(--interactive-wait etc.): the comparison, not the product",
            "warm-up": "each fresh adaptive gateway first gets --warmup-s of unmeasured 1x "
                       "traffic (a deployed gateway has learned its engines already)",
        }}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        adaptive_outs: list[Outcome] = []
        capacity = args.capacity
        if "homogeneous" in args.parts:
            outs, capacity = await homogeneous(session, args, out_dir, report)
            adaptive_outs += outs
        if "heterogeneous" in args.parts:
            adaptive_outs += await heterogeneous(session, args, out_dir, report)
        if "shift" in args.parts:
            await shift(session, args, out_dir, report, capacity or 3.0)
    errs = rel_errors(adaptive_outs)
    report["prediction"] = {"ttft_rel_err_p50": _q(errs, 0.5), "ttft_rel_err_p90": _q(errs, 0.9),
                            "samples": len(errs)}
    report["goals"] = goals(report)
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'setup':14} {'run':22} {'goodput':>8} {'inter':>6} {'std':>6} {'batch':>6}  shed"]
    f = lambda v: "-" if v is None else f"{v:6.1%}"  # noqa: E731
    for setup in ("homogeneous", "heterogeneous"):
        for run_name, r in (report.get(setup) or {}).items():
            if not isinstance(r, dict) or "goodput" not in r:
                continue
            a = r["slo_attainment"]
            lines.append(f"{setup:14} {run_name:22} {r['goodput']:8.2f} {f(a['interactive'])} "
                         f"{f(a['standard'])} {f(a['batch'])}  {r['shed']}")
    h = report.get("homogeneous") or {}
    if "oracle_interactive_3x" in h:
        lines.append(f"oracle_interactive_3x: {h['oracle_interactive_3x']}")
    if "shift" in report:
        s = report["shift"]
        lines.append(f"shift: convergence {s['convergence_s']} s, worst 10 s window "
                     f"{s['worst_window_attainment']}, limits by phase {s['limit_by_phase']}")
    lines.append(f"prediction: {report['prediction']}")
    for name, g in report["goals"].items():
        lines.append(f"goal {name}: {g['value']} (goal {g['goal']}) "
                     f"{'met' if g['met'] else 'MISSED' if g['met'] is False else '-'}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest adaptive",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--out-dir", default="out/adaptive", help="logs, configs, per-request lines")
    p.add_argument("--parts", nargs="+", choices=("homogeneous", "heterogeneous", "shift"),
                   default=["homogeneous", "heterogeneous", "shift"])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="cpu-gemma3-270m")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--het-speeds", type=float, nargs="+", default=[0.5, 1.0, 1.0, 2.0])
    p.add_argument("--duration", type=float, default=40.0, help="send window per run, s")
    p.add_argument("--drain", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="unmeasured 1x traffic through each fresh adaptive gateway first, s "
                   "(the benchmark measures a running gateway, not its first minute)")
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--probe-batches", type=int, nargs="+", default=[4, 6, 8, 10])
    p.add_argument("--probe-duration", type=float, default=30.0)
    p.add_argument("--probe-warmup", type=float, default=10.0)
    p.add_argument("--interactive-reserve", type=int, default=3)
    p.add_argument("--queue-max", type=int, default=256)
    p.add_argument("--interactive-wait", type=float, default=0.7)
    p.add_argument("--standard-wait", type=float, default=0.5)
    p.add_argument("--batch-wait", type=float, default=0.5)
    p.add_argument("--shift-phase", type=float, default=40.0, help="s per workload phase")
    p.add_argument("--shift-load", type=float, default=2.0, help="× homogeneous capacity")
    p.add_argument("--capacity", type=float,
                   help="1x in req/s: homogeneous skips its probe (with --per-engine as the "
                   "static limit and oracle slots); shift uses it when homogeneous is "
                   "skipped")
    p.add_argument("--per-engine", type=int, default=8,
                   help="the probe's best batch when --capacity is given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int,
                   help="homogeneous runs per load level and shift runs, each on its own "
                   "arrivals, pooled (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="shorter runs (~8 min): probes 6 8 10 of 15 s, 25 s windows, "
                   "10 s drain, 25 s shift phases, one repeat unless --repeat; not the benchmark")
    args = p.parse_args(argv)
    if args.quick:
        args.probe_batches, args.probe_duration, args.probe_warmup = [6, 8, 10], 15.0, 5.0
        args.duration, args.drain, args.shift_phase = 25.0, 10.0, 25.0
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0
