"""``python -m loadtest realprompts --json PATH [--limit N]``: the gateway's cost on a
real engine.

Sends Arena-Hard v0.1 prompts as streamed chat requests (max_tokens 64) at
concurrency 1 and 8, straight to the engine and through the gateway, in the same
run. Drift in the machine's speed (other jobs on a shared machine) must hit both
paths alike: at concurrency 1 the first N (``--limit``, default 100; ``--c1-limit``
bounds them) alternate path by path, prompt by prompt. At concurrency 8 the run has
``--rounds`` (default 5) rounds, each run on both paths back to back, the path that
goes first alternating round by round (ABBA): 8 closed-loop clients send the round's
prompts (a slice of all 500, the same sequence on both paths, cycled if used up), each
client its next one as soon as its previous answer ends, for ``--round-s`` (default
30) s. A path's throughput is the output tokens streamed within that window (content
chunks, on both paths; the requests still running at its end are waited for, their
later tokens not counted) over its length, so both paths are measured while the
engine is saturated: a fixed list of prompts would end each round with a ramp-down
whose length depends on which of the last requests are served, and an SLO gateway
rightly sheds a request that would start past its TTFT target while the ramp-down
leaves slots idle. Counting tokens rather than whole requests keeps the figure
whole on an engine slow enough that a request at concurrency 8 outlasts the window.
Its ``requests_s`` is that token rate over the mean output tokens of a request.
``throughput_ratio_c8`` is the median of the rounds' ratios (one round
disturbed by a burst of other work does not decide it); ``throughput_ratio_c8_pooled``
the ratio of all rounds' tokens. ``gateway_cpu_c8``: the CPU of the gateway's own
processes over its c8 windows, cores (it shares this machine's cores with a CPU
engine; None for a gateway given by URL).
Prompts are cut to ``--max-prompt-chars`` (default 4,000 ≈ 1,000 tokens) so they fit
the engine's 2,048-token context.

Without ``--gateway-url``/``--engine-url`` it starts ``sluice serve`` with the shipped
default config (one CPU vLLM engine on the packaged Gemma 3 270M) and measures that;
``--engine-kind llamacpp`` replaces that engine by llama.cpp's ``llama-server`` on the
packaged GGUF (``loadtest.launch.llamacpp_config``; ``make llama-server`` first).

Then, unless ``--overload-s 0``, a short overload run: Poisson arrivals of the same
prompts at ``--overload-load`` (default 2) × the engine's capacity — the requests per
second it completed at concurrency 8 straight — for ``--overload-s`` (default 60) s,
from three tenants of the mixed-tenants shares (interactive 30 %, standard 50 %, batch
20 %: :data:`loadtest.workloads.scenarios.TENANTS`), first straight to the engine, then
through the gateway, the same arrivals; requests still running ``--drain-s`` after the
window are cancelled (misses). A request is good when its TTFT and TPOT meet its band's
SLO (the gateway's shipped ``slo`` defaults, :class:`config.schema.SloConfig`); rejected
requests count as misses.

``prediction``: ``|TTFT̂ − TTFT| / TTFT`` over the requests the gateway served streamed
in all phases, TTFT̂ from ``x-sluice-ttft-predicted-ms`` (the adaptive admission's
prediction when it sent the request) and TTFT the client's less the gateway's queue
wait (``x-sluice-queue-ms``).

JSON: ``{"engine_kind", "direct_headers", "limit", "round_s", "direct"|"gateway":
{"c1"|"c8": {ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, output_tok_s, requests_s, errors}},
"throughput_ratio_c8": gateway/direct (median of the rounds), "throughput_ratio_c8_rounds":
[per round], "throughput_ratio_c8_pooled", "gateway_cpu_c8", "gateway_limit_c8_rounds":
[the gateway's concurrency limit for the engine after each round],
"ttft_p50_added_ms_c1", "prediction":
{ttft_rel_err_p50, ttft_rel_err_p90, samples}, "overload": {load, capacity_rps, rate,
duration_s, slo, "direct"|"gateway": {goodput, slo_attainment: {interactive, standard,
batch}, shed, offered}, interactive_ratio: gateway/direct} (or {skipped: why}, when no
c8 token was streamed straight within a window), "load_avg": [1-min load
average at start, end], "config": {changed}}`` (``c8`` figures pool all rounds).
``config.changed``: the settings that differ from the shipped configuration and why
(the launched gateway gets three tenants with the three priorities, for the overload
run). ``direct_headers``: with llama.cpp the direct
client sends ``Connection: close`` (llama-server drops the connection after each stream
while announcing keep-alive; the gateway does the same, ``engines.kinds.llamacpp``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from config.schema import PRIORITIES, SloConfig
from gateway.auth import hash_key
from loadtest.client import Measured, percentile_ms, send_measured
from loadtest.workloads.arena import read_prompts
from loadtest.workloads.base import poisson_times
from loadtest.workloads.scenarios import TENANTS

#: API key of each overload tenant (:data:`TENANTS`: name, priority, …, share, …).
KEY_OF = {name: f"realprompts-{name}" for name, *_ in TENANTS}


def summarize(results: list[Measured], wall_s: float,
              streamed: int | None = None) -> dict[str, Any]:
    """Latency percentiles of the served ``results`` and throughput over ``wall_s`` s:
    their output tokens and requests, or, given ``streamed`` (the content chunks that
    arrived within the window, :func:`_run_for`), those chunks per second and, as
    requests per second, that rate over the mean output tokens of a served request."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    if not wall_s:
        tok_s = req_s = 0.0
    elif streamed is None:
        tok_s, req_s = tokens / wall_s, len(ok) / wall_s
    else:
        tok_s = streamed / wall_s
        req_s = tok_s * len(ok) / tokens if tokens else 0.0
    return {
        "ttft_p50_ms": percentile_ms([r.ttft_s for r in ok], 50),
        "ttft_p99_ms": percentile_ms([r.ttft_s for r in ok], 99),
        "tpot_p50_ms": percentile_ms([r.tpot_s for r in ok], 50),
        "output_tok_s": round(tok_s, 2),
        "requests_s": round(req_s, 3),
        "errors": len(results) - len(ok),
    }


def rel_errors(results: list[Measured]) -> list[float]:
    """``|TTFT̂ − TTFT| / TTFT`` of the served streamed requests that carry the
    gateway's prediction; TTFT is the client's less the gateway's queue wait, s."""
    out = []
    for r in results:
        predicted = r.headers.get("x-sluice-ttft-predicted-ms")
        if not r.ok or predicted is None or r.ttft_s is None:
            continue
        actual = r.ttft_s - (r.queue_ms or 0.0) / 1000
        if actual > 0:
            out.append(abs(float(predicted) / 1000 - actual) / actual)
    return out


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def _body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}


async def _run_for(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                   concurrency: int, duration_s: float, headers: dict[str, str] | None = None,
                   ) -> tuple[list[Measured], int]:
    """Closed loop for ``duration_s`` s: ``concurrency`` clients, each sending the next of
    ``bodies`` (cycled) as soon as its previous answer ends. Returns the results of the
    requests sent within the window (those running at its end are waited for) and the
    content chunks that arrived within it: the window's throughput counts every token
    streamed while all clients were busy, however long one request takes."""
    results: list[Measured] = []
    sent = 0
    start = time.perf_counter()
    end = start + duration_s

    async def client() -> None:
        nonlocal sent
        while time.perf_counter() < end:
            body, sent = bodies[sent % len(bodies)], sent + 1
            results.append(await send_measured(session, url, body, headers))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, sum(t <= end for r in results for t in r.chunk_at)


async def _gateway_limit(session: aiohttp.ClientSession, gateway: str) -> float | None:
    """The gateway's ``sluice_engine_concurrency_limit`` (its only engine), or None."""
    async with session.get(gateway + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("sluice_engine_concurrency_limit{"):
            return float(line.rpartition(" ")[2])
    return None


async def measure(engine: str, gateway: str, model: str, prompts: list[str],
                  max_tokens: int, direct_headers: dict[str, str] | None = None,
                  rounds: int = 5, c1_limit: int | None = None, *,
                  c8_prompts: list[str] | None = None, round_s: float = 30.0,
                  gateway_cpu_s: Callable[[], float] | None = None,
                  ) -> tuple[dict[str, Any], list[Measured]]:
    """Both paths at c1 (the first ``c1_limit`` of ``prompts``, default all) then at c8
    in ``rounds`` ABBA rounds of ``round_s`` s over slices of ``c8_prompts`` (default
    ``prompts``; module docstring); ``direct_headers`` go with every direct request;
    ``gateway_cpu_s``: the gateway's CPU so far, s (for ``gateway_cpu_c8``; None: not
    measured, a gateway this process did not start). Returns the report
    and the gateway's results (for the prediction error)."""
    paths = {"direct": engine + "/v1/chat/completions", "gateway": gateway + "/v1/chat/completions"}
    headers = {"direct": direct_headers, "gateway": None}
    bodies = [_body(model, p, max_tokens) for p in prompts]
    c8_bodies = [_body(model, p, max_tokens) for p in (c8_prompts or prompts)]
    out: dict[str, Any] = {"direct": {}, "gateway": {}}
    through_gateway: list[Measured] = []
    async with aiohttp.ClientSession() as session:
        for name, url in paths.items():  # warm up both paths (connections, engine caches)
            await send_measured(session, url, _body(model, "Hello", 4), headers[name])
        c1: dict[str, list[Measured]] = {"direct": [], "gateway": []}
        spent = {"direct": 0.0, "gateway": 0.0}
        for i, body in enumerate(bodies[:c1_limit]):
            order = ["direct", "gateway"] if i % 2 == 0 else ["gateway", "direct"]
            for name in order:
                t = time.perf_counter()
                c1[name].append(await send_measured(session, paths[name], body, headers[name]))
                spent[name] += time.perf_counter() - t
        for name in paths:
            out[name]["c1"] = summarize(c1[name], spent[name])
        through_gateway += c1["gateway"]
        c8: dict[str, list[Measured]] = {"direct": [], "gateway": []}
        streamed = {"direct": 0, "gateway": 0}
        ratios, limits, cpu_s = [], [], 0.0
        for r in range(rounds):
            chunk = c8_bodies[r * len(c8_bodies) // rounds:(r + 1) * len(c8_bodies) // rounds]
            rate = {}
            for name in (["direct", "gateway"] if r % 2 == 0 else ["gateway", "direct"]):
                cpu0 = gateway_cpu_s() if gateway_cpu_s and name == "gateway" else 0.0
                results, chunks = await _run_for(session, paths[name], chunk, 8, round_s,
                                                 headers[name])
                if gateway_cpu_s and name == "gateway":
                    cpu_s += gateway_cpu_s() - cpu0
                c8[name] += results
                streamed[name] += chunks
                rate[name] = chunks / round_s
                if name == "gateway":
                    through_gateway += results
                    limits.append(await _gateway_limit(session, gateway))
            if rate["direct"]:
                ratios.append(round(rate["gateway"] / rate["direct"], 4))
        for name in paths:
            out[name]["c8"] = summarize(c8[name], rounds * round_s, streamed[name])
    d, g = out["direct"], out["gateway"]
    out["throughput_ratio_c8"] = round(statistics.median(ratios), 4) if ratios else None
    out["throughput_ratio_c8_rounds"] = ratios
    out["throughput_ratio_c8_pooled"] = (round(g["c8"]["output_tok_s"] / d["c8"]["output_tok_s"], 4)
                                         if d["c8"]["output_tok_s"] else None)
    out["gateway_cpu_c8"] = round(cpu_s / (rounds * round_s), 3) if gateway_cpu_s else None
    out["gateway_limit_c8_rounds"] = limits
    if d["c1"]["ttft_p50_ms"] is not None and g["c1"]["ttft_p50_ms"] is not None:
        out["ttft_p50_added_ms_c1"] = round(g["c1"]["ttft_p50_ms"] - d["c1"]["ttft_p50_ms"], 2)
    return out, through_gateway


# ----------------------------------------------------------------------------- overload


def arrivals(rate: float, duration_s: float, n_prompts: int, seed: int,
             ) -> list[tuple[float, str, int]]:
    """Poisson(``rate``) arrival times within ``duration_s`` s, each with a tenant drawn
    by :data:`TENANTS`' shares and a prompt index (cycling a seeded order)."""
    rng = random.Random(seed)
    times = [t for t in poisson_times(int(rate * duration_s * 1.5) + 10, rate, rng)
             if t < duration_s]
    order = list(range(n_prompts))
    rng.shuffle(order)
    return [(t, rng.choices([x[0] for x in TENANTS], [x[3] for x in TENANTS])[0],
             order[i % n_prompts]) for i, t in enumerate(times)]


def score(results: list[tuple[str, Measured | None]], slo: SloConfig,
          duration_s: float) -> dict[str, Any]:
    """Goodput (good requests/s over the window) and SLO attainment per band;
    ``None`` results (cancelled at the deadline) and rejections are misses."""
    band_of = {name: prio for name, prio, *_ in TENANTS}
    by_band: dict[str, list[bool]] = {p: [] for p in PRIORITIES}
    shed: Counter[str] = Counter()
    for tenant, m in results:
        band = band_of[tenant]
        target = slo.target(band)
        if m is None:
            shed["cancelled_at_deadline"] += 1
        elif not m.ok:
            shed[f"{m.status}:{m.error_code}"] += 1
        by_band[band].append(m is not None and m.ok and m.ttft_s is not None
                             and m.ttft_s <= target.ttft_s and (m.tpot_s or 0.0) <= target.tpot_s)
    return {
        "goodput": round(sum(sum(v) for v in by_band.values()) / duration_s, 3),
        "slo_attainment": {b: (round(sum(v) / len(v), 3) if v else None)
                           for b, v in by_band.items()},
        "shed": dict(sorted(shed.items())),
        "offered": len(results),
    }


async def _open_loop(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                     plan: list[tuple[float, str, int]], drain_s: float, *, auth: bool,
                     direct_headers: dict[str, str] | None,
                     ) -> list[tuple[str, Measured | None]]:
    """Send ``plan`` (time s, tenant, prompt index) to ``url``; cancel what still runs
    ``drain_s`` after the last arrival."""
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Measured]] = []
    for at, tenant, i in plan:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        headers = {"Authorization": f"Bearer {KEY_OF[tenant]}"} if auth else direct_headers
        tasks.append(asyncio.create_task(send_measured(session, url, bodies[i], headers)))
    if tasks:
        await asyncio.wait(tasks, timeout=drain_s)
    for t in tasks:
        t.cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    return [(tenant, m if isinstance(m, Measured) else None)
            for (_, tenant, _), m in zip(plan, done, strict=True)]


async def _wait_idle(session: aiohttp.ClientSession, engine: str, timeout_s: float = 60) -> None:
    """Until the engine reports nothing running or waiting (vLLM's gauges), or
    ``timeout_s``; an engine without them is given ``timeout_s`` / 6."""
    from engines.kinds.vllm import parse_metrics

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(engine + "/metrics") as r:
                snap = parse_metrics(await r.text(), 0.0) if r.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            snap = None
        if snap is None:
            await asyncio.sleep(timeout_s / 6)
            return
        if snap.num_running + snap.num_waiting == 0:
            return
        await asyncio.sleep(0.5)


async def overload(engine: str, gateway: str, model: str, prompts: list[str], max_tokens: int,
                   capacity_rps: float, args: argparse.Namespace,
                   direct_headers: dict[str, str] | None = None,
                   ) -> tuple[dict[str, Any], list[Measured]]:
    """The same arrivals at ``args.overload_load`` × ``capacity_rps`` straight to the
    engine, then through the gateway; returns the report and the gateway's results."""
    rate = args.overload_load * capacity_rps
    plan = arrivals(rate, args.overload_s, len(prompts), args.seed)
    bodies = [_body(model, p, max_tokens) for p in prompts]
    slo = SloConfig()
    out: dict[str, Any] = {"load": args.overload_load, "capacity_rps": round(capacity_rps, 3),
                           "rate": round(rate, 3), "duration_s": args.overload_s,
                           "drain_s": args.drain_s, "slo": slo.model_dump()}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await _wait_idle(session, engine)
        direct = await _open_loop(session, engine + "/v1/chat/completions", bodies, plan,
                                  args.drain_s, auth=False, direct_headers=direct_headers)
        out["direct"] = score(direct, slo, args.overload_s)
        await _wait_idle(session, engine)
        through = await _open_loop(session, gateway + "/v1/chat/completions", bodies, plan,
                                   args.drain_s, auth=True, direct_headers=None)
        out["gateway"] = score(through, slo, args.overload_s)
    d = out["direct"]["slo_attainment"]["interactive"]
    g = out["gateway"]["slo_attainment"]["interactive"]
    out["interactive_ratio"] = round(g / d, 3) if d and g is not None else None
    return out, [m for _, m in through if m is not None]


def _config_dir(directory: Path, engine_kind: str) -> Path:
    """The shipped configuration (llama.cpp's for ``engine_kind`` llamacpp) with the
    overload tenants added to ``tenants.yaml``."""
    from loadtest.launch import CONFIG_DIR, llamacpp_config

    if engine_kind == "llamacpp":
        llamacpp_config(directory)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("gateway.yaml", "engines.yaml", "tenants.yaml"):
            shutil.copy(CONFIG_DIR / name, directory / name)
    tenants = yaml.safe_load((directory / "tenants.yaml").read_text())
    tenants["tenants"] += [{"name": name, "priority": prio,
                            "api_key_hashes": [hash_key(KEY_OF[name])]}
                           for name, prio, *_ in TENANTS]
    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    return directory


async def run(engine: str, gateway: str, prompts: list[str], args: argparse.Namespace,
              direct: dict[str, str] | None, c8_prompts: list[str],
              gateway_cpu_s: Callable[[], float] | None = None) -> dict[str, Any]:
    result, through = await measure(engine, gateway, args.model, prompts, args.max_tokens,
                                    direct, args.rounds, args.c1_limit, c8_prompts=c8_prompts,
                                    round_s=args.round_s, gateway_cpu_s=gateway_cpu_s)
    capacity = result["direct"]["c8"]["requests_s"]
    if args.overload_s > 0 and capacity > 0:
        result["overload"], more = await overload(engine, gateway, args.model, prompts,
                                                  args.max_tokens, capacity, args, direct)
        through += more
    elif args.overload_s > 0:  # nothing streamed within a c8 window: no rate to scale
        result["overload"] = {"skipped": "the engine streamed no token within a c8 "
                              "window straight (capacity 0 requests/s)"}
    errs = rel_errors(through)
    result["prediction"] = {"ttft_rel_err_p50": _q(errs, 0.5),
                            "ttft_rel_err_p90": _q(errs, 0.9), "samples": len(errs)}
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest realprompts", description=__doc__)
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-chars", type=int, default=4000)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--gateway-url", help="a running gateway (its tenants must include "
                    "the overload tenants' keys, KEY_OF, for the overload run)")
    ap.add_argument("--engine-url")
    ap.add_argument("--engine-kind", choices=["vllm", "llamacpp"], default="vllm",
                    help="engine sluice serve launches (default vllm, the shipped config)")
    ap.add_argument("--overload-s", type=float, default=60.0,
                    help="send window of the overload run per path, s (0: skip it)")
    ap.add_argument("--overload-load", type=float, default=2.0,
                    help="overload arrival rate, × the engine's capacity at concurrency 8")
    ap.add_argument("--drain-s", type=float, default=30.0,
                    help="s after the overload window before unfinished requests are cancelled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5,
                    help="ABBA rounds of the concurrency-8 phase (default 5)")
    ap.add_argument("--round-s", type=float, default=30.0,
                    help="closed-loop window of each path in each concurrency-8 round, s")
    ap.add_argument("--c1-limit", type=int,
                    help="prompts of the concurrency-1 phase (default: all --limit)")
    args = ap.parse_args(argv)
    load_start = os.getloadavg()[0]
    every = [p[: args.max_prompt_chars] for p in read_prompts("v0.1")]
    prompts = every[: args.limit]
    # llama-server closes the connection after each stream though it announces keep-alive
    # (engines.kinds.llamacpp); the direct client closes it too, as the gateway does,
    # so neither path reuses a dead connection
    direct = {"Connection": "close"} if args.engine_kind == "llamacpp" else None
    changed: dict[str, str] = {}
    if args.gateway_url and args.engine_url:
        result = asyncio.run(run(args.engine_url, args.gateway_url, prompts, args, direct,
                                 every))
    else:
        import tempfile

        from loadtest.launch import gateway

        changed["tenants.yaml"] = ("three tenants added, one per priority (interactive, "
                                   "standard, batch), for the overload run's bands")
        with tempfile.TemporaryDirectory(prefix="sluice-realprompts-") as tmp, \
                gateway(_config_dir(Path(tmp), args.engine_kind)) as gw:
            (engine,) = gw.engine_urls(args.model)
            result = asyncio.run(run(engine, gw.url, prompts, args, direct, every,
                                     gw.cpu_s))
    result = {"engine_kind": args.engine_kind, "direct_headers": direct, "limit": args.limit,
              "rounds": args.rounds, "round_s": args.round_s, "c1_limit": args.c1_limit,
              **result,
              "load_avg": [load_start, os.getloadavg()[0]], "config": {"changed": changed}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0
