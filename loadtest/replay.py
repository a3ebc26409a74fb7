"""``python -m loadtest replay --workload NAME --target URL …``: open-loop replay.

Requests leave at their workload times whatever happens to earlier ones (open
loop), for at most ``--duration`` s; in-flight requests then get ``--drain`` s to
finish. Each result is one JSON line (``--out``): tenant, priority, HTTP status, error
code, queue time (``x-sluice-queue-ms`` response header), TTFT, TPOT, E2E (ms),
tokens, engine (``x-sluice-engine``). Engines given with ``--engine-metrics URL``
are scraped every ``--scrape-interval`` s (load over time) and before/after (prefix
hit rate from their own counters). The report (``--json``) and PNG plots
(``--plots DIR``) come from :mod:`loadtest.report`.

Routing benchmark: ``--engines N --policy P`` replaces ``--target``: a gateway
(``sluice serve``) is started with ``N`` simulated engines and scheduler policy
``P`` (:data:`POLICIES`; ``default`` is the ``scheduler:`` section of the shipped
``config/engines.yaml``), the workload is replayed through it, and the report adds
``ideal_hit_rate`` (unlimited cache, the replayed part of a Mooncake trace) and the
flat keys ``ttft_p50_ms``, ``ttft_p90_ms``, ``ttft_p99_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
import yaml
from tqdm import tqdm

from engines.metrics import parse_metrics
from engines.pool import MetricsSnapshot
from loadtest.launch import gateway
from loadtest.report import EngineSample, EngineStats, Result, Slo, format_summary, plot, summarize
from loadtest.workloads import WORKLOADS, RequestSpec, WorkloadOptions, build_workload
from loadtest.workloads.mooncake import ideal_hit_rate, read_trace, trace_path

_REPO = Path(__file__).resolve().parents[1]


def _shipped_scheduler() -> dict:
    raw = yaml.safe_load((_REPO / "config" / "engines.yaml").read_text(encoding="utf-8"))
    return raw["scheduler"]


#: Scheduler sections compared by the routing benchmark (``--policy``).
POLICIES = {
    "round-robin": lambda: {"filters": [], "scorers": [], "picker": {"type": "round-robin"}},
    "least-load": lambda: {"filters": [], "scorers": [{"type": "queue-depth"}],
                           "picker": {"type": "max-score"}},
    "prefix-only": lambda: {"filters": [], "scorers": [{"type": "prefix-affinity"}],
                            "picker": {"type": "max-score"}},
    "default": _shipped_scheduler,
}


def write_sim_config(folder: Path, engines: int, policy: str, model: str, sim_args: list[str],
                     index_bytes: int, prefix_source: str | None = None) -> Path:
    """A config folder for ``sluice serve``: ``engines`` simulated engines
    (``kind: sim`` with ``sim_args``), scheduler ``policy`` (prefix index capped at
    ``index_bytes``; its ``source`` replaced by ``prefix_source`` when given),
    anonymous access, no response cache (every request must reach
    an engine), and admission limits loose enough that the engines' own schedulers
    queue (``max_waiting`` high): the benchmark compares placement, not shedding."""
    folder.mkdir(parents=True, exist_ok=True)
    sched = POLICIES[policy]()
    sched["prefix"] = {**sched.get("prefix", {}), "max_bytes": index_bytes}
    if prefix_source is not None:
        sched["prefix"]["source"] = prefix_source
    (folder / "engines.yaml").write_text(yaml.safe_dump({
        "engines": [{"name": "sim", "model": model, "kind": "sim", "replicas": engines,
                     "args": sim_args}],
        "scheduler": sched,
        "supervisor": {"metrics_interval_s": 0.25, "startup_grace_s": 120,
                       "inference_probe_idle_s": 3600},
        "saturation": {"max_waiting": 100_000},
    }, sort_keys=False), encoding="utf-8")
    (folder / "gateway.yaml").write_text(yaml.safe_dump({
        "cache": {"enabled": False},
        "queue": {"max_requests": 100_000, "max_tokens": 10**10, "default_max_wait_s": 600},
        "observability": {"access_log": False, "tracing": False},
    }), encoding="utf-8")
    (folder / "tenants.yaml").write_text(yaml.safe_dump({"allow_anonymous": True}),
                                         encoding="utf-8")
    return folder


def replayed_ideal_hit_rate(workload: str, opts: WorkloadOptions) -> float | None:
    """:func:`~loadtest.workloads.mooncake.ideal_hit_rate` of the Mooncake records the
    replay sends (same time scale, duration and limit as the builder); None for
    other workloads."""
    if workload == "mooncake-conversation":
        path = trace_path()
    elif Path(workload).is_file():
        path = Path(workload)
    else:
        return None
    timed = sorted(((r["timestamp"] / 1000.0 * opts.time_scale, r) for r in read_trace(path)),
                   key=lambda x: x[0])
    records = [r for at, r in timed if opts.duration_s is None or at < opts.duration_s]
    records = records[: opts.limit] if opts.limit is not None else records
    if opts.max_input_tokens:
        records = [{**r, "input_length": min(r["input_length"], opts.max_input_tokens)}
                   for r in records]
    return ideal_hit_rate(records)


class Replayer:
    """Sends a workload's requests to ``target`` at their times.

    Args:
        target: gateway or engine base URL (no ``/v1``).
        api_keys: tenant → list of API keys (``RequestSpec.api_key_slot`` indexes it);
            tenants without keys send none.
        duration_s: stop sending after this, s; drain_s: then wait this long, s.
    """

    def __init__(self, target: str, api_keys: dict[str, list[str]], duration_s: float,
                 drain_s: float = 30.0) -> None:
        self.target = target.rstrip("/")
        self.api_keys = api_keys
        self.duration_s = duration_s
        self.drain_s = drain_s

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        keys = self.api_keys.get(spec.tenant) or []
        if not keys:
            return {}
        return {"Authorization": f"Bearer {keys[spec.api_key_slot % len(keys)]}"}

    async def _one(self, session: aiohttp.ClientSession, i: int, spec: RequestSpec) -> Result:
        res = Result(i, spec.tenant, spec.priority, spec.at_s, status=0)
        t0 = time.perf_counter()
        token_times: list[float] = []
        try:
            async with session.post(self.target + spec.endpoint, json=spec.body,
                                    headers=self._headers(spec)) as r:
                res.status = r.status
                res.engine = r.headers.get("x-sluice-engine")
                res.prefix_tokens = _prefix_tokens(r.headers.get("x-sluice-prefix-tokens"))
                q = r.headers.get("x-sluice-queue-ms")
                res.queue_ms = float(q) if q else None
                if r.status != 200:
                    try:
                        err = (await r.json(content_type=None)).get("error", {})
                        code = err.get("code")  # OpenAI: a string; vLLM: the status
                        res.error_code = str(code if isinstance(code, str)
                                             else err.get("type") or r.status)
                    except (ValueError, AttributeError):
                        res.error_code = str(r.status)
                elif spec.body.get("stream"):
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        choices = chunk.get("choices") or []
                        if choices and (choices[0].get("text")
                                        or (choices[0].get("delta") or {}).get("content")):
                            token_times.append(time.perf_counter() - t0)
                        if chunk.get("usage"):
                            self._usage(res, chunk["usage"])
                        if "error" in chunk:
                            res.error_code = str(chunk["error"].get("code", "stream_error"))
                else:
                    body = await r.json()
                    token_times.append(time.perf_counter() - t0)
                    self._usage(res, body.get("usage") or {})
        except (TimeoutError, aiohttp.ClientError) as exc:
            res.error_code = type(exc).__name__
        except asyncio.CancelledError:
            res.error_code = "cancelled_at_deadline"
        res.e2e_ms = 1000 * (time.perf_counter() - t0)
        if token_times:
            res.ttft_ms = 1000 * token_times[0]
            if len(token_times) > 1:
                res.tpot_ms = 1000 * (token_times[-1] - token_times[0]) / (len(token_times) - 1)
        return res

    @staticmethod
    def _usage(res: Result, usage: dict) -> None:
        res.prompt_tokens = usage.get("prompt_tokens")
        res.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            res.cached_tokens = details["cached_tokens"]

    async def run(self, specs: list[RequestSpec], engines: list[EngineStats],
                  scrape_interval_s: float = 1.0) -> tuple[list[Result], float]:
        """Replay ``specs`` (sorted by ``at_s``); returns results and wall time, s."""
        specs = [s for s in specs if s.at_s < self.duration_s]
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            before = [await _scrape(session, e.url) for e in engines]
            start = time.perf_counter()
            scraper = asyncio.create_task(self._scrape_loop(session, engines, start,
                                                            scrape_interval_s))
            bar = tqdm(total=len(specs), unit="req", file=sys.stderr)
            tasks: list[asyncio.Task[Result]] = []
            for i, spec in enumerate(specs):
                delay = start + spec.at_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._one(session, i, spec))
                task.add_done_callback(lambda _: bar.update())
                tasks.append(task)
            done, pending = await asyncio.wait(tasks, timeout=self.drain_s) if tasks else ((), ())
            for t in pending:
                t.cancel()
            results = list(await asyncio.gather(*tasks))
            wall = time.perf_counter() - start
            bar.close()
            scraper.cancel()
            for e, b in zip(engines, before, strict=False):
                a = await _scrape(session, e.url)
                if a is not None and b is not None:
                    e.queries_delta = a.prefix_cache_queries - b.prefix_cache_queries
                    e.hits_delta = a.prefix_cache_hits - b.prefix_cache_hits
        return results, wall

    async def _scrape_loop(self, session: aiohttp.ClientSession, engines: list[EngineStats],
                           start: float, interval_s: float) -> None:
        while True:
            t = time.perf_counter() - start
            for e, m in zip(engines, await asyncio.gather(
                    *(_scrape(session, e.url) for e in engines)), strict=False):
                if m is not None:
                    e.samples.append(EngineSample(t, m.num_running, m.num_waiting,
                                                  m.kv_cache_usage or 0.0))
            await asyncio.sleep(interval_s)


def _prefix_tokens(header: str | None) -> dict[str, int] | None:
    """``x-sluice-prefix-tokens: events=N, approximate=M`` as a dict (None if absent)."""
    if not header:
        return None
    out: dict[str, int] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if value.isdigit():
            out[name] = int(value)
    return out or None


async def _scrape(session: aiohttp.ClientSession, url: str) -> MetricsSnapshot | None:
    """The engine's ``url/metrics`` (:func:`engines.metrics.parse_metrics`); None when
    unreachable or unparsable."""
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as r:
            return parse_metrics(await r.text(), time.monotonic())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True,
                   help=f"one of {', '.join(WORKLOADS)}, or a Mooncake-format file")
    p.add_argument("--target", help="base URL (gateway or engine); or use --engines")
    p.add_argument("--engines", type=int,
                   help="start a gateway with this many simulated engines and replay through it")
    p.add_argument("--policy", default="default", choices=sorted(POLICIES),
                   help="scheduler policy of that gateway (with --engines)")
    p.add_argument("--sim-profile", default="h200-llama3-8b")
    p.add_argument("--sim-num-blocks", type=int, default=200_000,
                   help="KV blocks per simulated engine")
    p.add_argument("--sim-max-model-len", type=int,
                   help="override the profile's max_model_len (a smaller KV cache needs it)")
    p.add_argument("--sim-speed", type=float,
                   help="simulated seconds per wall second (default 1 / --time-scale)")
    p.add_argument("--index-bytes", type=int, default=512 << 20,
                   help="prefix index memory cap of that gateway, bytes")
    p.add_argument("--prefix-source", choices=["events", "approximate"],
                   help="scheduler.prefix.source of that gateway (default: the policy's)")
    p.add_argument("--config-out", help="keep the generated config folder here")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--duration", type=float, default=60.0, help="send window, s")
    p.add_argument("--drain", type=float, default=30.0, help="wait for in-flight, s")
    p.add_argument("--limit", type=int, help="at most this many requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace time multiplier")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson rate, req/s")
    p.add_argument("--max-input-tokens", type=int)
    p.add_argument("--max-output-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--api-key", action="append", default=[], metavar="TENANT=KEY",
                   help="repeat; several keys per tenant fill its api_key_slots in order")
    p.add_argument("--engine-metrics", action="append", default=[], metavar="URL",
                   help="engine base URL to scrape (repeat)")
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--slo-ttft-ms", type=float, default=Slo.ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=Slo.tpot_ms)
    p.add_argument("--out", help="per-request JSON lines")
    p.add_argument("--json", help="report JSON")
    p.add_argument("--plots", help="directory for PNG plots")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if (args.target is None) == (args.engines is None):
        print("give exactly one of --target and --engines", file=sys.stderr)
        return 2
    opts = WorkloadOptions(model=args.model, limit=args.limit, duration_s=args.duration,
                           time_scale=args.time_scale, rate=args.rate,
                           max_input_tokens=args.max_input_tokens,
                           max_output_tokens=args.max_output_tokens, seed=args.seed,
                           stream=not args.no_stream)
    workload = build_workload(args.workload, opts)
    keys: dict[str, list[str]] = {}
    for item in args.api_key:
        tenant, _, key = item.partition("=")
        keys.setdefault(tenant, []).append(key)
    if args.engines is not None:
        summary, results, engines = _run_with_gateway(args, opts, workload, keys)
    else:
        engines = [EngineStats(u) for u in args.engine_metrics]
        replayer = Replayer(args.target, keys, args.duration, args.drain)
        results, wall = asyncio.run(replayer.run(workload.requests, engines,
                                                 args.scrape_interval))
        summary = summarize(results, engines, Slo(args.slo_ttft_ms, args.slo_tpot_ms), wall)
    summary["workload"] = workload.name
    print(format_summary(summary))
    for path in (args.out, args.json):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(asdict(r)) + "\n")
    if args.plots:
        summary["plots"] = [str(p) for p in plot(results, engines, Path(args.plots))]
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return 0


def _run_with_gateway(args: argparse.Namespace, opts: WorkloadOptions, workload,
                      keys: dict[str, list[str]]) -> tuple[dict, list[Result], list[EngineStats]]:
    """Start ``sluice serve`` with ``args.engines`` simulated engines and policy
    ``args.policy``, replay through it, and summarise with the routing keys."""
    import tempfile

    speed = args.sim_speed or 1.0 / args.time_scale
    sim_args = ["--profile", args.sim_profile, "--num-blocks", str(args.sim_num_blocks),
                "--speed", f"{speed:g}", "--enable-prompt-tokens-details"]
    if args.sim_max_model_len:
        sim_args += ["--max-model-len", str(args.sim_max_model_len)]
    folder = Path(args.config_out or tempfile.mkdtemp(prefix="sluice-bench-"))
    write_sim_config(folder, args.engines, args.policy, args.model, sim_args, args.index_bytes,
                     args.prefix_source)
    with gateway(folder, log_path=folder / "gateway.log") as gw:
        engines = [EngineStats(u) for u in gw.engine_urls()]
        replayer = Replayer(gw.url, keys, args.duration, args.drain)
        results, wall = asyncio.run(replayer.run(workload.requests, engines,
                                                 args.scrape_interval))
    summary = summarize(results, engines, Slo(args.slo_ttft_ms, args.slo_tpot_ms), wall)
    ttft = summary["ttft_ms"]
    summary.update({
        "policy": args.policy, "engines_n": args.engines,
        "ideal_hit_rate": replayed_ideal_hit_rate(args.workload, opts),
        "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"], "ttft_p99_ms": ttft["p99"],
        "setup": {"sim_args": sim_args, "prefix_source": args.prefix_source,
                  "time_scale": args.time_scale, "limit": args.limit,
                  "duration_s": args.duration, "config_dir": str(folder)},
    })
    return summary, results, engines
