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
``ideal_hit_rate`` (unlimited cache, the replayed part of a Mooncake trace),
``ttft_p90_bound_ms`` (no routing or scheduling can give a lower p90 TTFT on those
engines: :mod:`loadtest.ttft_bound`; None with ``--pd``) and the flat keys
``ttft_p50_ms``, ``ttft_p90_ms``, ``ttft_p99_ms``.

Several replicas: ``--gateways G`` (G ≥ 2, with ``--engines``) launches the ``N``
simulated engines itself (each publishing KV-cache events) and a private
``redis-server``, then starts ``G`` ``sluice serve`` processes that route to those
engines as ``kind: external`` (with their ``kv_events`` endpoints, so every gateway
follows the same events) and share limits through that Redis; requests go to the
gateways round-robin. The same workload is first replayed through one gateway as
above, and the report adds ``one_gateway`` (that run's ``prefix_hit_rate``,
``ideal_hit_rate`` and TTFT percentiles) and ``prefix_hit_rate_vs_one_gateway`` (G
gateways' hit rate / one gateway's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from engines.kinds.vllm import parse_metrics
from engines.pool import MetricsSnapshot
from loadtest.changed import changed_settings
from loadtest.launch import RedisServer, free_port, gateway
from loadtest.report import EngineSample, EngineStats, Result, Slo, format_summary, plot, summarize
from loadtest.sim_engine.profiles import Profile, get_profile
from loadtest.ttft_bound import percentile_bound_s, prefill_seconds
from loadtest.workloads import WORKLOADS, RequestSpec, WorkloadOptions, build_workload
from loadtest.workloads.mooncake import ideal_hit_rate, ideal_hits, read_trace, trace_path

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
    # the shipped filters, with predicted TTFT (prefix hits and queued prefill in
    # seconds) in place of prefix-affinity + queue-depth + kv-cache-usage
    "predicted-ttft": lambda: {**_shipped_scheduler(), "scorers": [
        {"type": "predicted-ttft", "weight": 2.0}, {"type": "session-affinity", "weight": 2.0},
        {"type": "kv-cache-usage", "weight": 0.5}]},
}


#: Why :func:`write_sim_config` changes the settings it changes from the shipped ones
#: (:func:`loadtest.changed.changed_settings` prints them in the report's
#: ``setup.changed``).
SIM_CONFIG_REASONS = {
    "gateway.cache": "off: every request must reach an engine",
    "gateway.observability": "access log and tracing off: the simulated engines share the "
                             "2 cores with the gateway (`python -m loadtest overhead` "
                             "measures their cost)",
    "gateway.queue": "bounds and wait loose enough that nothing is shed by the queue: the "
                     "benchmark compares placement, not shedding",
    "engines.saturation.max_waiting": "the engines' own schedulers queue (the trace's "
                                      "bursts arrive up to 16 at once): placement, not "
                                      "shedding",
    "engines.scheduler": "--policy: the routing policy compared",
    "engines.supervisor.metrics_interval_s": "four scrapes a second: the engines' load and "
                                             "the learned model follow the trace's bursts",
    "engines.supervisor.startup_grace_s": "simulated engines start in seconds",
    "engines.supervisor.inference_probe_idle_s": "no inference probes mixed into the "
                                                 "replayed traffic",
    "engines.disaggregation": "--pd: the disaggregation under test",
    "gateway.limits.store_url": "--gateways N: the replicas share one private Redis",
}


def write_sim_config(folder: Path, engines: int, policy: str, model: str, sim_args: list[str],
                     index_bytes: int, pd: tuple[int, int] | None = None,
                     disaggregation: dict | None = None, prefix_source: str | None = None) -> Path:
    """A config folder for ``sluice serve``: ``engines`` simulated engines
    (``kind: sim`` with ``sim_args``), scheduler ``policy`` (prefix index capped at
    ``index_bytes``; its ``source`` replaced by ``prefix_source`` when given),
    anonymous access, no response cache (every request must reach
    an engine), and admission limits loose enough that the engines' own schedulers
    queue (``max_waiting`` high): the benchmark compares placement, not shedding.

    ``pd`` = (prefill, decode) engine counts splits the fleet into ``role: prefill``
    and ``role: decode`` engines with the simulator's ``NixlConnector``, and
    ``disaggregation`` becomes the engines file's section of that name."""
    folder.mkdir(parents=True, exist_ok=True)
    sched = POLICIES[policy]()
    sched["prefix"] = {**sched.get("prefix", {}), "max_bytes": index_bytes}
    if prefix_source is not None:
        sched["prefix"]["source"] = prefix_source
    if pd is None:
        specs = [{"name": "sim", "model": model, "kind": "sim", "replicas": engines,
                  "args": sim_args}]
    else:
        if sum(pd) != engines:
            raise ValueError(f"--pd {pd[0]}:{pd[1]} does not add up to {engines} engines")
        specs = [{"name": r, "model": model, "kind": "sim", "replicas": n, "role": r,
                  "kv_connector": "NixlConnector", "args": sim_args}
                 for r, n in (("prefill", pd[0]), ("decode", pd[1]))]
    (folder / "engines.yaml").write_text(yaml.safe_dump({
        "engines": specs,
        **({"disaggregation": disaggregation} if pd is not None and disaggregation else {}),
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


def replayed_records(workload: str, opts: WorkloadOptions) -> list[dict] | None:
    """The Mooncake records the replay sends (same time scale, duration and limit as
    the builder, prompts capped at ``max_input_tokens``), in arrival order; None for
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
    return records


def replayed_ideal_hit_rate(workload: str, opts: WorkloadOptions) -> float | None:
    """:func:`~loadtest.workloads.mooncake.ideal_hit_rate` of :func:`replayed_records`;
    None for other workloads."""
    records = replayed_records(workload, opts)
    return None if records is None else ideal_hit_rate(records)


def replayed_ttft_p90_bound_ms(workload: str, opts: WorkloadOptions, profile: Profile,
                               engines: int, speed: float) -> float | None:
    """:func:`~loadtest.ttft_bound.percentile_bound_s` (p90, ms) of
    :func:`replayed_records` on ``engines`` engines of ``profile`` running at ``speed``
    simulated seconds per second; None for other workloads."""
    records = replayed_records(workload, opts)
    if not records:
        return None
    jobs = [(r["timestamp"] / 1000.0 * opts.time_scale,
             prefill_seconds(profile, max(1, r["input_length"] - hit)) / speed)
            for r, hit in zip(records, ideal_hits(records), strict=True)]
    return 1000 * percentile_bound_s(jobs, engines, 90.0)


class Replayer:
    """Sends a workload's requests to ``target`` at their times.

    Args:
        target: gateway or engine base URL (no ``/v1``), or several gateways'; the
            ``i``-th request goes to ``target[i % len(target)]`` (round-robin).
        api_keys: tenant → list of API keys (``RequestSpec.api_key_slot`` indexes it);
            tenants without keys send none.
        duration_s: stop sending after this, s; drain_s: then wait this long, s.
    """

    def __init__(self, target: str | Sequence[str], api_keys: dict[str, list[str]],
                 duration_s: float, drain_s: float = 30.0) -> None:
        self.targets = [t.rstrip("/") for t in ([target] if isinstance(target, str) else target)]
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
            target = self.targets[i % len(self.targets)]
            async with session.post(target + spec.endpoint, json=spec.body,
                                    headers=self._headers(spec)) as r:
                res.status = r.status
                res.engine = r.headers.get("x-sluice-engine")
                res.prefill_engine = r.headers.get("x-sluice-prefill-engine")
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
            transfers_before = [await _transfers(session, e.url) for e in engines]
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
            for e, (n0, b0) in zip(engines, transfers_before, strict=True):
                n1, b1 = await _transfers(session, e.url)
                e.transfers_delta, e.transfer_bytes_delta = n1 - n0, b1 - b0
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
    """The engine's ``url/metrics`` (:func:`engines.kinds.vllm.parse_metrics`); None when
    unreachable or unparsable."""
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as r:
            return parse_metrics(await r.text(), time.monotonic())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def _transfers(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """KV transfers an engine has read and their bytes so far
    (``vllm:nixl_xfer_time_seconds_count``, ``vllm:nixl_bytes_transferred_sum``);
    zeros without a connector or when unreachable."""
    wanted = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum")
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError):
        return 0.0, 0.0
    lines = "\n".join(line for line in text.splitlines() if line.startswith(wanted))
    sums = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums[wanted[0]], sums[wanted[1]]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True,
                   help=f"one of {', '.join(WORKLOADS)}, or a Mooncake-format file")
    p.add_argument("--target", help="base URL (gateway or engine); or use --engines")
    p.add_argument("--engines", type=int,
                   help="start a gateway with this many simulated engines and replay through it")
    p.add_argument("--gateways", type=int, default=1,
                   help="with --engines: this many sluice serve replicas on one Redis, "
                        "requests round-robin (also runs one gateway for comparison)")
    p.add_argument("--policy", default="default", choices=sorted(POLICIES),
                   help="scheduler policy of that gateway (with --engines)")
    p.add_argument("--sim-profile", default="h200-llama3-8b")
    p.add_argument("--sim-num-blocks", type=int, default=200_000,
                   help="KV blocks per simulated engine")
    p.add_argument("--sim-max-model-len", type=int,
                   help="override the profile's max_model_len (a smaller KV cache needs it)")
    p.add_argument("--sim-speed", type=float,
                   help="simulated seconds per wall second (default: the workload's, "
                        "else 1 / --time-scale)")
    p.add_argument("--pd", type=_pd, metavar="P:D",
                   help="with --engines: P prefill and D decode engines (disaggregated)")
    p.add_argument("--pd-policy", choices=("predicted", "threshold"), default="predicted",
                   help="split choice: per-request prediction, or a fixed prompt threshold")
    p.add_argument("--pd-threshold-tokens", type=int, default=512,
                   help="prompt tokens from which --pd-policy threshold splits")
    p.add_argument("--pd-max-stall-ms", type=float,
                   help="disaggregation.max_decode_stall_ms of --pd-policy predicted "
                        "(default: the shipped one, from the TPOT target)")
    p.add_argument("--kv-transfer-gbps", type=float, default=100.0,
                   help="KV transfer bandwidth between simulated engines, Gbit/s")
    p.add_argument("--index-bytes", type=int, default=512 << 20,
                   help="prefix index memory cap of that gateway, bytes")
    p.add_argument("--prefix-source", choices=["events", "approximate"],
                   help="scheduler.prefix.source of that gateway (default: the policy's)")
    p.add_argument("--config-out", help="keep the generated config folder here")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--duration", type=float, default=60.0, help="send window, s")
    p.add_argument("--drain", type=float, default=30.0, help="wait for in-flight, s")
    p.add_argument("--limit", type=int, help="at most this many requests")
    p.add_argument("--time-scale", type=float,
                   help="trace time multiplier (default: the workload's, else 1)")
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


def _pd(text: str) -> tuple[int, int]:
    p, _, d = text.partition(":")
    try:
        counts = int(p), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError("need at least one prefill and one decode engine")
    return counts


#: Replay settings per workload, used where the command line gives none.
#: azure-code (Azure 2023 code trace: prompts of 2,139 tokens on average, 26 output
#: tokens) on h200-llama3-8b engines (~31k prefill tokens/s each): --time-scale 0.2 at
#: --sim-speed 1 replays the 600 first requests 5x faster in simulated time, 600
#: requests in 52 s, 24.5k prompt tokens/s on average (a fifth of four engines'
#: prefill capacity) but in bursts: the busiest tenth of 1-s windows bring over 73k
#: tokens/s and the busiest 246k. Four aggregated engines then run near capacity:
#: TTFT p90 at the 2 s SLO and long prefill chunks stretching the decode steps of the
#: streams batched with them (TPOT p90 far past 100 ms), what disaggregation removes.
WORKLOAD_DEFAULTS: dict[str, dict[str, float]] = {
    "azure-code": {"time_scale": 0.2, "sim_speed": 1.0},
}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if (args.target is None) == (args.engines is None):
        print("give exactly one of --target and --engines", file=sys.stderr)
        return 2
    if args.pd is not None and args.engines is None:
        print("--pd needs --engines", file=sys.stderr)
        return 2
    if args.gateways > 1 and (args.engines is None or args.pd is not None):
        print("--gateways needs --engines (and no --pd)", file=sys.stderr)
        return 2
    defaults = WORKLOAD_DEFAULTS.get(args.workload, {})
    args.applied_defaults = {k: v for k, v in defaults.items() if getattr(args, k) is None}
    for k, v in args.applied_defaults.items():
        setattr(args, k, v)
    if args.time_scale is None:
        args.time_scale = 1.0
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
    if args.engines is not None and args.gateways > 1:
        one, _, _ = _run_with_gateway(args, opts, workload, keys, gateways=1)
        summary, results, engines = _run_with_gateway(args, opts, workload, keys,
                                                      gateways=args.gateways)
        summary["one_gateway"] = {k: one[k] for k in (
            "prefix_hit_rate", "ideal_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")}
        hit, one_hit = summary["prefix_hit_rate"], one["prefix_hit_rate"]
        summary["prefix_hit_rate_vs_one_gateway"] = (
            round(hit / one_hit, 4) if hit is not None and one_hit else None)
    elif args.engines is not None:
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
                      keys: dict[str, list[str]], gateways: int = 1,
                      ) -> tuple[dict, list[Result], list[EngineStats]]:
    """Start ``sluice serve`` with ``args.engines`` simulated engines and policy
    ``args.policy`` (``gateways`` > 1: that many replicas, see :func:`_replicas`),
    replay through it, and summarise with the routing keys."""
    import tempfile

    speed = args.sim_speed or 1.0 / args.time_scale
    sim_args = ["--profile", args.sim_profile, "--num-blocks", str(args.sim_num_blocks),
                "--speed", f"{speed:g}", "--enable-prompt-tokens-details"]
    if args.sim_max_model_len:
        sim_args += ["--max-model-len", str(args.sim_max_model_len)]
    disaggregation = None
    if args.pd is not None:
        sim_args += ["--kv-transfer-gbps", f"{args.kv_transfer_gbps:g}"]
        # what an operator knows of the fleet: the model's KV bytes per token and the
        # link between engines
        disaggregation = {"policy": args.pd_policy, "threshold_tokens": args.pd_threshold_tokens,
                          "kv_bytes_per_token": get_profile(args.sim_profile).kv_bytes_per_token,
                          "transfer_gbps": args.kv_transfer_gbps}
        if args.pd_max_stall_ms is not None:
            disaggregation["max_decode_stall_ms"] = args.pd_max_stall_ms
    folder = Path(args.config_out or tempfile.mkdtemp(prefix="sluice-bench-"))
    if gateways > 1:
        folder = folder / f"gateways-{gateways}"
    write_sim_config(folder, args.engines, args.policy, args.model, sim_args, args.index_bytes,
                     args.pd, disaggregation, args.prefix_source)
    with ExitStack() as stack:
        if gateways == 1:
            gw = stack.enter_context(gateway(folder, log_path=folder / "gateway.log"))
            urls, engine_urls = [gw.url], gw.engine_urls()
        else:
            urls, engine_urls = stack.enter_context(_replicas(folder, gateways, sim_args))
        engines = [EngineStats(u) for u in engine_urls]
        replayer = Replayer(urls, keys, args.duration, args.drain)
        results, wall = asyncio.run(replayer.run(workload.requests, engines,
                                                 args.scrape_interval))
    summary = summarize(results, engines, Slo(args.slo_ttft_ms, args.slo_tpot_ms), wall)
    ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
    summary.update({
        "policy": args.policy, "engines_n": args.engines,
        "pd": None if args.pd is None else f"{args.pd[0]}:{args.pd[1]}",
        "pd_policy": None if args.pd is None else args.pd_policy, "gateways": gateways,
        "ideal_hit_rate": replayed_ideal_hit_rate(args.workload, opts),
        "ttft_p90_bound_ms": None if args.pd is not None else replayed_ttft_p90_bound_ms(
            args.workload, opts, get_profile(args.sim_profile), args.engines, speed),
        "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"], "ttft_p99_ms": ttft["p99"],
        "tpot_p50_ms": tpot["p50"], "tpot_p90_ms": tpot["p90"], "tpot_p99_ms": tpot["p99"],
        "setup": {"sim_args": sim_args, "prefix_source": args.prefix_source,
                  "time_scale": args.time_scale, "limit": args.limit,
                  "duration_s": args.duration, "config_dir": str(folder),
                  "workload_defaults": args.applied_defaults,
                  "disaggregation": disaggregation,
                  "changed": changed_settings(folder, SIM_CONFIG_REASONS)},
    })
    return summary, results, engines


@contextmanager
def _replicas(folder: Path, gateways: int, sim_args: list[str],
              ) -> Iterator[tuple[list[str], list[str]]]:
    """Turn the config in ``folder`` (written by :func:`write_sim_config`) into
    ``gateways`` replicas: launch its simulated engines here (each with a KV-event
    publisher, :func:`engines.supervisor.kv_events_flag`) and a private Redis, list
    the engines as ``kind: external`` with their ``kv_events`` and the Redis as
    ``limits.store_url``, and run that many ``sluice serve`` on the folder. Yields the
    gateways' and the engines' base URLs; stops them all on exit."""
    from engines.supervisor import kv_events_flag

    engines_yaml = yaml.safe_load((folder / "engines.yaml").read_text(encoding="utf-8"))
    gateway_yaml = yaml.safe_load((folder / "gateway.yaml").read_text(encoding="utf-8"))
    (spec,) = engines_yaml["engines"]
    taken: set[int] = set()
    with ExitStack() as stack:
        redis = RedisServer()
        redis.start()
        stack.callback(redis.stop)
        externals, engine_urls = [], []
        for i in range(spec["replicas"]):
            name, port = f"{spec['name']}-{i}", free_port()
            endpoint, flag = kv_events_flag(name, "127.0.0.1", taken)
            log = stack.enter_context(open(folder / f"{name}.log", "wb"))
            proc = subprocess.Popen(
                [sys.executable, "-m", "loadtest.sim_engine", "--host", "127.0.0.1",
                 "--port", str(port), "--model", spec["model"], *sim_args, *flag],
                stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_terminate, proc)
            engine_urls.append(f"http://127.0.0.1:{port}")
            externals.append({"name": name, "model": spec["model"], "kind": "external",
                              "url": engine_urls[-1], "cache_salt": True,
                              "kv_events": {"endpoint": endpoint.endpoint,
                                            "replay_endpoint": endpoint.replay,
                                            "topic": endpoint.topic}})
        engines_yaml["engines"] = externals
        gateway_yaml["limits"] = {"store_url": redis.url}
        (folder / "engines.yaml").write_text(yaml.safe_dump(engines_yaml, sort_keys=False),
                                             encoding="utf-8")
        (folder / "gateway.yaml").write_text(yaml.safe_dump(gateway_yaml), encoding="utf-8")
        urls = [stack.enter_context(gateway(folder, log_path=folder / f"gateway-{g}.log")).url
                for g in range(gateways)]
        yield urls, engine_urls


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
