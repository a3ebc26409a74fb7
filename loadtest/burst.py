"""``python -m loadtest burst --engine-kind vllm --json PATH``: closed-loop bursts
against the engine the shipped configuration launches, straight and through
``sluice serve`` with that configuration, interleaved in one run.

At each concurrency (``--clients``, default 1, 8, 32, 128, 512) ``c`` closed-loop
clients each send a streamed chat of a short Arena-Hard v0.1 prompt (the shortest
``--prompts`` prompts of the shared set, default 200, each at most
``--max-prompt-chars``; ``max_tokens`` ``--max-tokens``, default 32) and the next
as soon as the answer ends, for ``--duration-s`` (default 60) s per path. A client
waits at most ``--timeout-s`` (default 60) s for an answer (then counts a timeout and
sends its next); a refused client (429/503) waits its ``Retry-After``, capped at
``--retry-cap-s`` (default 2) s, or 1 s without one, and sends again. At the window's
end no client sends again, and the requests still running are waited for (each until
its answer or its timeout): their timeouts and refusals count, their latencies count,
but only answers within the window count in ``answered_per_s`` and ``tokens_per_s``
(a request sent at the window's start could otherwise never reach its timeout within
it). Before each path the run
waits until the engine reports nothing running or waiting (at most ``--idle-s``,
default 120 s), so one path's backlog does not land on the other. The two paths
alternate which goes first from one concurrency to the next.

``--engine-kind llamacpp`` replaces the engine by llama.cpp's ``llama-server`` on
the packaged GGUF (:func:`loadtest.launch.llamacpp_config`); ``--gateway-url`` and
``--engine-url`` measure running ones instead of launching.

JSON: ``{"engine_kind", "clients", "duration_s", "max_tokens", "timeout_s",
"retry_cap_s", "direct"|"gateway": {"<c>": {answered_per_s, answered, timeouts,
refused, refused_with_retry_after, refusal_s_p99, latency_s_p50, latency_s_p99,
latency_s_mean, tokens_per_s, errors}}, "peak_direct_answered_per_s", "goals": {...}, "load_avg":
[1-min load average at start, end], "config": {"changed": {}}}``; ``latency_s_*`` are
the answered requests' (send to last byte), ``refusal_s_p99`` the refused ones'
(send to the refusal), ``tokens_per_s`` the answered requests' completion tokens per
second of the window. ``goals`` checks the issue's targets (41): through the gateway
at every concurrency ≥ 8 ``answered_per_s`` ≥ 0.9 × the peak direct one, no timeout,
every refusal with ``Retry-After``; at 8, where the direct path has no timeout,
≥ 0.95 × its tokens/s and no refusal; at ≥ 32 ``latency_s_p50`` ≤ 2 × the gateway's
own at 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from engines.kinds import KINDS
from loadtest.client import Measured, send_measured
from loadtest.workloads.arena import read_prompts

CLIENTS = (1, 8, 32, 128, 512)


def short_prompts(count: int = 200, max_chars: int = 400) -> list[str]:
    """The ``count`` shortest Arena-Hard v0.1 prompts, each cut to ``max_chars``."""
    return [p[:max_chars] for p in sorted(read_prompts("v0.1"), key=len)[:count]]


def chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed chat of ``prompt`` with usage in the stream."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


@dataclass
class Tally:
    """What one closed-loop window saw (times in s)."""

    duration_s: float
    answered: int = 0  # within the window
    latencies: list[float] = field(default_factory=list)
    refusal_s: list[float] = field(default_factory=list)
    tokens: int = 0
    timeouts: int = 0
    refused: int = 0
    refused_with_retry_after: int = 0
    errors: int = 0

    def summary(self) -> dict[str, Any]:
        """The JSON figures of the window (module docstring)."""
        def q(xs: list[float], p: float) -> float | None:
            return round(float(np.percentile(xs, p)), 3) if xs else None

        return {"answered_per_s": round(self.answered / self.duration_s, 4),
                "answered": self.answered, "timeouts": self.timeouts,
                "refused": self.refused,
                "refused_with_retry_after": self.refused_with_retry_after,
                "refusal_s_p99": q(self.refusal_s, 99),
                "latency_s_p50": q(self.latencies, 50), "latency_s_p99": q(self.latencies, 99),
                "latency_s_mean": round(float(np.mean(self.latencies)), 3)
                if self.latencies else None,
                "tokens_per_s": round(self.tokens / self.duration_s, 3),
                "errors": self.errors}


def retry_after_s(m: Measured) -> float | None:
    """The ``Retry-After`` of a refusal, s (None when absent or not a number)."""
    value = next((v for k, v in m.headers.items() if k.lower() == "retry-after"), None)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def closed_loop(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                      clients: int, duration_s: float, *, timeout_s: float = 60.0,
                      retry_cap_s: float = 2.0, headers: dict[str, str] | None = None,
                      seed: int = 0) -> Tally:
    """``clients`` closed-loop clients POST ``bodies`` (client ``i`` starts at a
    seeded offset and cycles) to ``url`` for ``duration_s`` s, then wait for the
    requests still running (each at most ``timeout_s``); tallied as the module
    docstring says."""
    tally = Tally(duration_s)
    start = time.perf_counter()
    end = start + duration_s
    rng = random.Random(seed)

    async def client(i: int) -> None:
        k = rng.randrange(len(bodies))
        while time.perf_counter() < end:
            m = await send_measured(session, url, bodies[k % len(bodies)], headers,
                                    timeout_s=timeout_s)
            k += 1
            within = time.perf_counter() <= end
            if m.ok:
                tally.latencies.append(m.e2e_s)
                if within:
                    tally.answered += 1
                    tally.tokens += m.completion_tokens
            elif m.error_code == "TimeoutError":
                tally.timeouts += 1
            elif m.status in (429, 503):
                tally.refused += 1
                tally.refusal_s.append(m.e2e_s)
                wait = retry_after_s(m)
                if wait is not None:
                    tally.refused_with_retry_after += 1
                pause = min(retry_cap_s, 1.0 if wait is None else wait)
                await asyncio.sleep(max(0.0, min(pause, end - time.perf_counter())))
            else:
                tally.errors += 1
                # a failing server is not hammered in a loop
                await asyncio.sleep(max(0.0, min(0.5, end - time.perf_counter())))

    await asyncio.gather(*(client(i) for i in range(clients)))
    return tally


async def wait_idle(session: aiohttp.ClientSession, engine: str, kind: str,
                    limit_s: float) -> bool:
    """Wait until ``engine``'s metrics page (its dialect ``kind``'s) shows nothing
    running or waiting (True), or ``limit_s`` s passed (False). An engine without
    those metrics: True at once."""
    dialect = KINDS[kind]
    if dialect.metrics_path is None or dialect.parse is None:
        return True
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            async with session.get(engine + dialect.metrics_path) as r:
                if r.status != 200:
                    return True
                snap = dialect.parse(await r.text(), 0.0, None)
            if "running" not in snap.signals or snap.num_running + snap.num_waiting == 0:
                return True
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(1.0)
    return False


def goals(direct: dict[str, dict[str, Any]], gateway: dict[str, dict[str, Any]]
          ) -> dict[str, Any]:
    """The issue's targets, checked on the figures (module docstring)."""
    peak = max((d["answered_per_s"] for d in direct.values()), default=0.0)
    out: dict[str, Any] = {}
    c8 = gateway.get("8")
    for c, g in gateway.items():
        if int(c) < 8:
            continue
        out[c] = {"answered_vs_peak": round(g["answered_per_s"] / peak, 3) if peak else None,
                  "answered_ok": g["answered_per_s"] >= 0.9 * peak,
                  "no_timeout": g["timeouts"] == 0,
                  "refusals_with_retry_after": g["refused"] == g["refused_with_retry_after"]}
        if int(c) >= 32 and c8 and c8["latency_s_p50"] and g["latency_s_p50"] is not None:
            out[c]["latency_p50_vs_c8"] = round(g["latency_s_p50"] / c8["latency_s_p50"], 3)
            out[c]["latency_ok"] = g["latency_s_p50"] <= 2 * c8["latency_s_p50"]
    d8 = direct.get("8")
    if c8 and d8 and d8["timeouts"] == 0 and d8["tokens_per_s"]:
        out["c8_tokens_vs_direct"] = round(c8["tokens_per_s"] / d8["tokens_per_s"], 3)
        out["c8_ok"] = c8["tokens_per_s"] >= 0.95 * d8["tokens_per_s"] and c8["refused"] == 0
    return out


async def run(engine: str, gateway: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = short_prompts(args.prompts, args.max_prompt_chars)
    bodies = [chat_body(args.model, p, args.max_tokens) for p in prompts]
    direct_headers = {"Connection": "close"} if args.engine_kind == "llamacpp" else None
    paths = {"direct": (engine, direct_headers), "gateway": (gateway, None)}
    out: dict[str, dict[str, Any]] = {"direct": {}, "gateway": {}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        for n, c in enumerate(args.clients):
            order = ["direct", "gateway"] if n % 2 == 0 else ["gateway", "direct"]
            for path in order:
                idle = await wait_idle(session, engine, args.engine_kind, args.idle_s)
                base, headers = paths[path]
                tally = await closed_loop(session, base + "/v1/chat/completions", bodies, c,
                                          args.duration_s, timeout_s=args.timeout_s,
                                          retry_cap_s=args.retry_cap_s, headers=headers,
                                          seed=args.seed + c)
                out[path][str(c)] = {**tally.summary(), "engine_idle_at_start": idle}
                print(f"c={c} {path}: {json.dumps(out[path][str(c)])}", flush=True)
    peak = max((d["answered_per_s"] for d in out["direct"].values()), default=0.0)
    return {**out, "peak_direct_answered_per_s": peak,
            "goals": goals(out["direct"], out["gateway"])}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m loadtest burst",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--engine-kind", choices=["vllm", "llamacpp"], default="vllm",
                    help="engine sluice serve launches (default vllm, the shipped config)")
    ap.add_argument("--clients", type=ints, default=list(CLIENTS))
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--retry-cap-s", type=float, default=2.0)
    ap.add_argument("--idle-s", type=float, default=120.0)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-prompt-chars", type=int, default=400)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--gateway-url")
    ap.add_argument("--engine-url")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    if args.gateway_url and args.engine_url:
        result = asyncio.run(run(args.engine_url, args.gateway_url, args))
    else:
        from loadtest.launch import gateway, llamacpp_config

        with tempfile.TemporaryDirectory(prefix="sluice-burst-") as tmp:
            config = llamacpp_config(Path(tmp)) if args.engine_kind == "llamacpp" else None
            with gateway(config, log_path=args.json.with_suffix(".gateway.log")) as gw:
                (engine,) = gw.engine_urls(args.model)  # not the embedding engine
                result = asyncio.run(run(engine, gw.url, args))
    result = {"engine_kind": args.engine_kind, "clients": args.clients,
              "duration_s": args.duration_s, "max_tokens": args.max_tokens,
              "timeout_s": args.timeout_s, "retry_cap_s": args.retry_cap_s, **result,
              "load_avg": [load_start, os.getloadavg()[0]], "config": {"changed": {}}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("peak_direct_answered_per_s", "goals")}, indent=2))
    return 0
