"""``python -m loadtest validate-sim --real URL --sim-profile NAME``: run the same
probes against a real vLLM engine and a simulated one and print them side by side.

Probes (completions with token-id prompts, so both engines see exactly the same
number of prompt tokens whatever their tokenizer; ``ignore_eos`` so the real engine
generates exactly ``max_tokens``):

* TTFT vs prompt length: one streaming request at a time, a fresh random prompt per
  repetition (no prefix hits), median over ``--reps``.
* TPOT and throughput vs concurrency: ``c`` concurrent streams of
  ``--output-tokens``; median per-request TPOT, aggregate output tok/s.
* Prefix cache: the same ``--prefix-len``-token prompt twice; the change in
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` and the
  second TTFT.

* Closed loop (``--closed-loop``, default 1, 8, 32, 128 clients, ``--closed-loop-s``
  s each, default 30): the short Arena-Hard chats of ``python -m loadtest burst``
  (``max_tokens`` 32, client timeout 60 s, :func:`loadtest.burst.closed_loop`):
  answered requests per second and their mean and median latency, front-end
  queueing included. The issue-41 target: answered/s and the mean latency (the one
  Little's law ties to it; the real engine's median sits well under its mean under
  load) within 20 % at every concurrency (``closed_loop_within_20pct`` in the JSON).

Without ``--real`` it launches the engine the shipped configuration launches
(``sluice serve``; its engine is probed straight) and probes that.

Output: a table (metric, real, sim, relative error = sim / real − 1) and, with
``--json PATH``, the same rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp

from engines.kinds.vllm import parse_metrics
from engines.pool import MetricsSnapshot
from loadtest.client import wait_healthy
from loadtest.launch import free_port

#: Token ids for random prompts: inside any modern vocabulary, above special tokens.
_TOKEN_RANGE = (1000, 30000)


@dataclass
class Row:
    metric: str
    unit: str
    real: float | None
    sim: float | None

    @property
    def rel_err(self) -> float | None:
        if self.real in (None, 0) or self.sim is None:
            return None
        return self.sim / self.real - 1


async def _model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(f"{base}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def _stream(session: aiohttp.ClientSession, base: str, model: str,
                  prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Send one streaming completion; returns (TTFT s, token arrival times s)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter() - t0)
    if not times:
        raise RuntimeError(f"{base}: stream produced no tokens")
    return times[0], times


async def _scrape(session: aiohttp.ClientSession, base: str) -> MetricsSnapshot:
    async with session.get(f"{base}/metrics") as r:
        return parse_metrics(await r.text(), time.monotonic())


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(n)]


async def probe(base: str, args: argparse.Namespace) -> dict[str, float]:
    """All probes against one engine; returns metric → value."""
    rng = random.Random(args.seed)
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        model = args.model or await _model(s, base)
        await _stream(s, base, model, _prompt(rng, 8), 2)  # warm-up
        for n in args.prompt_lens:
            ttfts = [(await _stream(s, base, model, _prompt(rng, n), 2))[0]
                     for _ in range(args.reps)]
            out[f"ttft_ms@prompt={n}"] = 1000 * statistics.median(ttfts)
        for c in args.concurrency:
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(_stream(s, base, model, _prompt(rng, 32),
                                                  args.output_tokens) for _ in range(c)))
            wall = time.perf_counter() - t0
            tpots = [(t[-1] - t[0]) / (len(t) - 1) for _, t in runs if len(t) > 1]
            out[f"tpot_ms@c={c}"] = 1000 * statistics.median(tpots)
            out[f"throughput_tok_s@c={c}"] = sum(len(t) for _, t in runs) / wall
        if args.skip_probes:
            return out | await closed_loop_probe(s, base, model, args)
        prompt = _prompt(rng, args.prefix_len)
        before = await _scrape(s, base)
        first, _ = await _stream(s, base, model, prompt, 2)
        second, _ = await _stream(s, base, model, prompt, 2)
        after = await _scrape(s, base)
        out["prefix_cache_queries_delta"] = after.prefix_cache_queries - before.prefix_cache_queries
        out["prefix_cache_hits_delta"] = after.prefix_cache_hits - before.prefix_cache_hits
        out["ttft_ms@prefix_first"] = 1000 * first
        out["ttft_ms@prefix_second"] = 1000 * second
        out |= await closed_loop_probe(s, base, model, args)
    return out


async def closed_loop_probe(session: aiohttp.ClientSession, base: str, model: str,
                            args: argparse.Namespace) -> dict[str, float]:
    """The closed-loop rows (module docstring) against ``base``."""
    from loadtest.burst import chat_body, closed_loop, short_prompts

    bodies = [chat_body(model, p, 32) for p in short_prompts()]
    out: dict[str, float] = {}
    for c in args.closed_loop:
        tally = (await closed_loop(session, base + "/v1/chat/completions", bodies, c,
                                   args.closed_loop_s, seed=args.seed + c)).summary()
        out[f"closed_loop_answered_per_s@clients={c}"] = tally["answered_per_s"]
        for stat in ("mean", "p50"):
            v = tally[f"latency_s_{stat}"]
            out[f"closed_loop_latency_ms_{stat}@clients={c}"] = 1000 * v if v else 0.0
    return out


def _unit(metric: str) -> str:
    return ("ms" if "_ms" in metric else "tok/s" if "tok_s" in metric
            else "req/s" if "per_s" in metric else "tokens")


def closed_loop_within(rows: list[Row], tolerance: float = 0.2) -> bool | None:
    """Whether every closed-loop row's simulated value is within ``tolerance`` of the
    real one (None when there is none)."""
    errs = [r.rel_err for r in rows if r.metric.startswith("closed_loop_")
            and "_p50@" not in r.metric]
    if not errs or any(e is None for e in errs):
        return None
    return all(abs(e) <= tolerance for e in errs)


async def _run(args: argparse.Namespace) -> list[Row]:
    if args.real is None:  # the engine the shipped configuration launches
        from loadtest.launch import gateway

        with gateway() as gw:
            # the generation engine (the shipped config also launches an embedding one)
            (args.real,) = gw.engine_urls(args.model or "gemma3-270m")
            return await _run(args)
    proc = None
    sim_url = args.sim
    if sim_url is None:
        port = free_port()
        async with aiohttp.ClientSession() as s:
            model = args.model or await _model(s, args.real)
        proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim_engine", "--port",
                                 str(port), "--model", model, "--profile", args.sim_profile,
                                 "--speed", str(args.speed)])
        sim_url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, sim_url, 30.0)
        real = await probe(args.real, args)
        sim = await probe(sim_url, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    # Simulated latencies at --speed s run s times faster than the device they model.
    scale = {k: (v * args.speed if "_ms" in k
                 else v / args.speed if "tok_s" in k or "per_s" in k else v)
             for k, v in sim.items()}
    return [Row(k, _unit(k), real.get(k), scale.get(k)) for k in real]


def format_table(rows: list[Row]) -> str:
    lines = [f"{'metric':34} {'unit':7} {'real':>10} {'sim':>10} {'rel.err':>8}"]
    for r in rows:
        err = "" if r.rel_err is None else f"{r.rel_err:+.1%}"
        fmt = lambda v: "-" if v is None else f"{v:10.1f}"  # noqa: E731
        lines.append(f"{r.metric:34} {r.unit:7} {fmt(r.real)} {fmt(r.sim)} {err:>8}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest validate-sim",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--real", help="base URL of the real engine (default: launch the "
                   "shipped configuration's engine)")
    p.add_argument("--sim", help="base URL of a running simulated engine")
    p.add_argument("--sim-profile", default="cpu-gemma3-270m",
                   help="profile of the simulated engine to start when --sim is absent")
    p.add_argument("--speed", type=float, default=1.0, help="speed of the started sim")
    p.add_argument("--model", help="model name (default: the real engine's first)")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--prompt-lens", type=ints, default=[16, 128, 372, 1024])
    p.add_argument("--concurrency", type=ints, default=[1, 4, 8, 16])
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=372)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--closed-loop", type=ints, default=[1, 8, 32, 128],
                   help="closed-loop client counts (empty: none)")
    p.add_argument("--closed-loop-s", type=float, default=30.0,
                   help="window of each closed-loop run, s")
    p.add_argument("--skip-probes", action="store_true",
                   help="only the closed-loop rows")
    p.add_argument("--json", help="write the rows here as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rows = asyncio.run(_run(args))
    print(format_table(rows))
    within = closed_loop_within(rows)
    if within is not None:
        print(f"closed loop within 20 %: {'yes' if within else 'no'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"real": args.real, "sim": args.sim or args.sim_profile,
                       "speed": args.speed, "closed_loop_within_20pct": within,
                       "rows": [{**asdict(r), "rel_err": r.rel_err} for r in rows]},
                      f, indent=2)
    return 0
