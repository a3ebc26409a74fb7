"""``python -m loadtest realprompts --json PATH [--limit N]``: the gateway's cost on a
real engine.

Sends the first N (default 100) Arena-Hard v0.1 prompts as streamed chat requests
(max_tokens 64) at concurrency 1 and 8, straight to the engine and through the
gateway, in the same run. Drift in the machine's speed (other jobs on a shared
machine) must hit both paths alike: at concurrency 1 they alternate prompt by
prompt; at concurrency 8 the prompts are split into ``--rounds`` (default 5) rounds,
each run on both paths back to back, the path that goes first alternating round by
round (ABBA), and ``throughput_ratio_c8`` is the median of the rounds' ratios (one
round disturbed by a burst of other work does not decide it). Prompts are cut to
``--max-prompt-chars`` (default 4,000 ≈ 1,000 tokens) so they fit the engine's
2,048-token context.

Without ``--gateway-url``/``--engine-url`` it starts ``sluice serve`` with the shipped
default config (one CPU vLLM engine on the packaged Gemma 3 270M) and measures that;
``--engine-kind llamacpp`` replaces that engine by llama.cpp's ``llama-server`` on the
packaged GGUF (``loadtest.launch.llamacpp_config``; ``make llama-server`` first).

JSON: ``{"engine_kind", "direct_headers", "limit", "direct"|"gateway": {"c1"|"c8":
{ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, output_tok_s, errors}}, "throughput_ratio_c8":
gateway/direct (median of the rounds), "throughput_ratio_c8_rounds": [per round],
"gateway_limit_c8_rounds": [the gateway's concurrency limit for the engine after each
round],
"ttft_p50_added_ms_c1", "load_avg": [1-min load average at start, end]}`` (``c8``
figures pool all rounds). ``direct_headers``: with llama.cpp the direct
client sends ``Connection: close`` (llama-server drops the connection after each stream
while announcing keep-alive; the gateway does the same, ``engines.kinds.llamacpp``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.client import Measured, percentile_ms, send_measured
from loadtest.workloads.arena import read_prompts


def summarize(results: list[Measured], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "ttft_p50_ms": percentile_ms([r.ttft_s for r in ok], 50),
        "ttft_p99_ms": percentile_ms([r.ttft_s for r in ok], 99),
        "tpot_p50_ms": percentile_ms([r.tpot_s for r in ok], 50),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall_s, 2) if wall_s else 0,
        "errors": len(results) - len(ok),
    }


def _body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}


async def _run_concurrent(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                          concurrency: int, headers: dict[str, str] | None = None,
                          ) -> tuple[list[Measured], float]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[Measured] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await send_measured(session, url, queue.get_nowait(), headers))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


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
                  rounds: int = 5, c1_limit: int | None = None) -> dict[str, Any]:
    """Both paths at c1 (the first ``c1_limit`` prompts, default all) then at c8 in
    ``rounds`` ABBA rounds (module docstring); ``direct_headers`` go with every direct
    request."""
    paths = {"direct": engine + "/v1/chat/completions", "gateway": gateway + "/v1/chat/completions"}
    headers = {"direct": direct_headers, "gateway": None}
    bodies = [_body(model, p, max_tokens) for p in prompts]
    out: dict[str, Any] = {"direct": {}, "gateway": {}}
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
        c8: dict[str, list[Measured]] = {"direct": [], "gateway": []}
        wall = {"direct": 0.0, "gateway": 0.0}
        ratios, limits = [], []
        for r in range(rounds):
            chunk = bodies[r * len(bodies) // rounds:(r + 1) * len(bodies) // rounds]
            rate = {}
            for name in (["direct", "gateway"] if r % 2 == 0 else ["gateway", "direct"]):
                results, took = await _run_concurrent(session, paths[name], chunk, 8,
                                                       headers[name])
                c8[name] += results
                wall[name] += took
                rate[name] = summarize(results, took)["output_tok_s"]
                if name == "gateway":
                    limits.append(await _gateway_limit(session, gateway))
            if rate["direct"]:
                ratios.append(round(rate["gateway"] / rate["direct"], 4))
        for name in paths:
            out[name]["c8"] = summarize(c8[name], wall[name])
    d, g = out["direct"], out["gateway"]
    out["throughput_ratio_c8"] = round(statistics.median(ratios), 4) if ratios else None
    out["throughput_ratio_c8_rounds"] = ratios
    out["gateway_limit_c8_rounds"] = limits
    if d["c1"]["ttft_p50_ms"] is not None and g["c1"]["ttft_p50_ms"] is not None:
        out["ttft_p50_added_ms_c1"] = round(g["c1"]["ttft_p50_ms"] - d["c1"]["ttft_p50_ms"], 2)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest realprompts", description=__doc__)
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-chars", type=int, default=4000)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--gateway-url")
    ap.add_argument("--engine-url")
    ap.add_argument("--engine-kind", choices=["vllm", "llamacpp"], default="vllm",
                    help="engine sluice serve launches (default vllm, the shipped config)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="ABBA rounds of the concurrency-8 phase (default 5)")
    ap.add_argument("--c1-limit", type=int,
                    help="prompts of the concurrency-1 phase (default: all --limit)")
    args = ap.parse_args(argv)
    load_start = os.getloadavg()[0]
    prompts = [p[: args.max_prompt_chars] for p in read_prompts("v0.1")[: args.limit]]
    # llama-server closes the connection after each stream though it announces keep-alive
    # (engines.kinds.llamacpp); the direct client closes it too, as the gateway does,
    # so neither path reuses a dead connection
    direct = {"Connection": "close"} if args.engine_kind == "llamacpp" else None
    if args.gateway_url and args.engine_url:
        result = asyncio.run(measure(args.engine_url, args.gateway_url, args.model, prompts,
                                     args.max_tokens, direct, args.rounds, args.c1_limit))
    else:
        import tempfile

        from loadtest.launch import gateway, llamacpp_config

        with tempfile.TemporaryDirectory(prefix="sluice-realprompts-") as tmp:
            config = llamacpp_config(Path(tmp)) if args.engine_kind == "llamacpp" else None
            with gateway(config) as gw:
                (engine,) = gw.engine_urls()
                result = asyncio.run(measure(engine, gw.url, args.model, prompts,
                                             args.max_tokens, direct, args.rounds, args.c1_limit))
    result = {"engine_kind": args.engine_kind, "direct_headers": direct, "limit": args.limit,
              "rounds": args.rounds, "c1_limit": args.c1_limit, **result,
              "load_avg": [load_start, os.getloadavg()[0]]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0
