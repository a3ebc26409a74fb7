"""``python -m loadtest batch --json PATH``: the Batch API as offline work on the
engines' spare capacity, on 4 simulated engines (profile ``cpu-gemma3-270m-quiet``,
the one the adaptive benchmark runs, whose mix and SLO this one reuses: the vLLM CPU
engine's own figures on a quiet machine, docs/engines.md. ``cpu-gemma3-270m``, the fit
to a burst on the busy shared machine, takes 114 ms a step alone, so no request there
meets the benchmark's 100 ms TPOT and the probe finds no capacity).

1. **probe** — :func:`loadtest.adaptive.probe`: the closed-loop capacity (requests/s
   within the 1 s TTFT / 100 ms TPOT SLO) and its best batch per engine ``b``
   (``--capacity``/``--per-engine`` skip it).
2. **per load** (``--loads``, default 0.5 and 0.8 × capacity) — the adaptive
   benchmark's mix (:func:`loadtest.overload.workload`, ``mixed-tenants``) without its
   ``batch``-priority tenant, thinned so the online requests (interactive 3/8,
   standard 5/8) arrive at load × capacity, open loop for ``--duration`` s (300):
   ``online_alone`` through a fresh gateway, then ``online_with_batch`` through
   another fresh one on the same arrivals, with a ``--batch-lines`` (3,000) batch
   submitted through ``POST /v1/files`` + ``/v1/batches`` at t = 0 by the ``initech``
   tenant. Each fresh gateway first serves ``--warmup-s`` of unmeasured online
   traffic (a running gateway has learned its engines).
   * ``slo_attainment``: online requests good (TTFT ≤ 1 s, TPOT ≤ 100 ms; rejected
     ones are misses) over all online requests.
   * ``batch.completed``: lines done when the window ends (or the batch);
     ``batch.lines_per_s``: that over the time it ran (the window, or until it ended).
   * ``spare_capacity_used``: the batch's output tokens/s over (capacity − online)
     output tokens/s, where capacity output tokens/s is the probe's requests/s ×
     the mean output tokens of the online-alone run's served requests, and both
     rates are taken over the time the batch ran.
   * ``fleet_utilisation_alone`` / ``_with_batch``: the engines' busy fraction —
     each engine's running requests over its capacity concurrency ``b`` (capped at
     1), sampled every 0.5 s from its ``/metrics``, averaged over engines and the
     window.
3. **restart** — a gateway on 4 engines at ``--restart-speed`` runs a
   ``--restart-lines`` batch alone, is SIGKILLed when half of it is done and started
   again on the same store; ``restart.lost``: ``custom_id`` s missing from the output
   and error files, ``restart.duplicated``: lines there more than once.

Settings changed from the shipped configuration (``config.changed`` in the report,
with reasons): the harness's (:data:`loadtest.overload.HARNESS_REASONS`), the online
bands' SLO at the benchmark's (the batch band keeps the shipped one), and
``gateway.batch.dir`` (the run's folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engines.kinds import KINDS
from loadtest.adaptive import BENCH_SLO, ENGINE_EXTRA, probe, rejections
from loadtest.changed import changed_settings
from loadtest.launch import RunningGateway, gateway
from loadtest.overload import (
    HARNESS_REASONS,
    KEY_OF,
    PRIORITY_OF,
    Engines,
    Outcome,
    open_loop,
    workload,
    write_gateway_config,
)
from loadtest.workloads import RequestSpec

#: The tenant that submits the batch (the mix's batch-priority tenant).
BATCH_TENANT = next(name for name, prio in PRIORITY_OF.items() if prio == "batch")
#: Share of the mix's arrivals that are online (interactive 0.3 + standard 0.5).
ONLINE_SHARE = 0.8
REASONS = {**HARNESS_REASONS,
           "gateway.slo": "the online bands at the benchmark's SLO (TTFT 1 s, TPOT 100 ms), "
                          "which scores them; the batch band keeps the shipped targets",
           "gateway.batch.dir": "the run's own folder: each gateway starts with no batch"}


def bench_config(directory: Path, urls: list[str], args: argparse.Namespace,
                 report: dict[str, Any]) -> Path:
    slo = {b: BENCH_SLO[b] for b in ("interactive", "standard")}
    cfg = write_gateway_config(directory, urls, args, {},
                               {"slo": slo, "batch": {"dir": str(directory / "batch")}},
                               queue_waits=False)
    report["config"]["changed"].update(changed_settings(cfg, REASONS))
    return cfg


def online(rate: float, duration_s: float, args: argparse.Namespace, seed: int) -> list[RequestSpec]:
    """The mix without its batch tenant, at ``rate`` online requests/s."""
    return [s for s in workload(rate / ONLINE_SHARE, duration_s, args, seed=seed)
            if s.priority != "batch"]


def batch_file(n: int, args: argparse.Namespace, seed: int) -> bytes:
    """``n`` lines of the batch tenant's requests (non-streaming chat completions)."""
    specs = [s for s in workload(1000.0, None, args, seed=seed, limit=n * 6)
             if s.tenant == BATCH_TENANT][:n]
    while len(specs) < n:  # the generator's share can fall short
        specs.append(random.Random(seed + len(specs)).choice(specs))
    out = []
    for i, s in enumerate(specs):
        body = {k: v for k, v in s.body.items() if k not in ("stream", "stream_options")}
        out.append(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                               "url": s.endpoint, "body": body}))
    return ("\n".join(out) + "\n").encode()


# ----------------------------------------------------------------------------- pieces


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY_OF[BATCH_TENANT]}"}


async def submit(session: aiohttp.ClientSession, url: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="batch.jsonl", content_type="application/jsonl")
    async with session.post(url + "/v1/files", data=form, headers=_auth()) as r:
        r.raise_for_status()
        file_id = (await r.json())["id"]
    async with session.post(url + "/v1/batches", headers=_auth(), json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}) as r:
        r.raise_for_status()
        return (await r.json())["id"]


async def batch_state(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/batches/{batch_id}", headers=_auth()) as r:
        r.raise_for_status()
        return await r.json()


async def batch_tokens(session: aiohttp.ClientSession, url: str) -> float:
    """Output tokens the batch tenant's lines generated so far (``sluice_tokens_total``)."""
    async with session.get(url + "/metrics") as r:
        return batch_output_tokens(await r.text())


def batch_output_tokens(text: str) -> float:
    """The batch tenant's completion tokens in a gateway's ``/metrics`` page
    (``sluice_tokens_total`` summed over its other labels)."""
    return sum(s.value for family in text_string_to_metric_families(text)
               if family.name == "sluice_tokens" for s in family.samples
               if s.name == "sluice_tokens_total" and s.labels.get("kind") == "completion"
               and s.labels.get("tenant") == BATCH_TENANT)


async def watch_end(session: aiohttp.ClientSession, url: str, batch_id: str | None,
                    t0: float, ended: dict[str, float]) -> None:
    """Set ``ended["at"]`` (s since ``t0``) when the batch ends; checked every second."""
    while batch_id is not None:
        state = await batch_state(session, url, batch_id)
        if state["status"] not in ("in_progress", "cancelling"):
            ended["at"] = time.perf_counter() - t0
            return
        await asyncio.sleep(1.0)


class BusySampler:
    """Every 0.5 s, each engine's running requests over ``per_engine`` (≤ 1)."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], per_engine: int) -> None:
        self.session, self.urls, self.per_engine = session, urls, per_engine
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        kind = KINDS["vllm"]
        while True:
            fractions = []
            for url in self.urls:
                try:
                    async with self.session.get(url + str(kind.metrics_path)) as r:
                        snap = kind.parse(await r.text(), 0.0, None)  # type: ignore[misc]
                    fractions.append(min(1.0, snap.num_running / self.per_engine))
                except aiohttp.ClientError:
                    pass
            if fractions:
                self.samples.append(sum(fractions) / len(fractions))
            await asyncio.sleep(0.5)

    def __enter__(self) -> BusySampler:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 3) if self.samples else None


def attainment(outcomes: list[Outcome]) -> dict[str, Any]:
    by: dict[str, list[Outcome]] = {"interactive": [], "standard": []}
    for o in outcomes:
        by.setdefault(o.priority, []).append(o)
    return {"slo_attainment": round(sum(o.good for o in outcomes) / len(outcomes), 4)
            if outcomes else None,
            "by_band": {b: round(sum(o.good for o in v) / len(v), 4) if v else None
                        for b, v in by.items()},
            "requests": len(outcomes),
            "rejected": sum(o.status != 200 for o in outcomes),
            "output_tokens": sum(o.completion_tokens for o in outcomes if o.status == 200)}


# ----------------------------------------------------------------------------- runs


async def run_load(session: aiohttp.ClientSession, engines: Engines, args: argparse.Namespace,
                   load: float, capacity: float, per_engine: int, out_dir: Path,
                   report: dict[str, Any]) -> dict[str, Any]:
    rate = load * capacity
    specs = online(rate, args.duration, args, seed=args.seed + int(load * 100))
    warm = online(rate, args.warmup_s, args, seed=args.seed + 7)
    res: dict[str, Any] = {"online_rate_per_s": round(rate, 3)}
    for with_batch in (False, True):
        name = f"load{load:g}-{'with' if with_batch else 'alone'}"
        cfg = bench_config(out_dir / name, engines.urls, args, report)
        with gateway(cfg, log_path=out_dir / f"{name}.log", ready_timeout_s=60) as gw:
            await engines.wait_idle(session)
            await open_loop(session, [gw.url], warm, args.warmup_s, args.drain, auth=True)
            await engines.wait_idle(session)
            batch_id = await submit(session, gw.url, batch_file(args.batch_lines, args,
                                                                args.seed + 77)) \
                if with_batch else None
            t0 = time.perf_counter()
            tokens0 = await batch_tokens(session, gw.url)
            shed0 = await rejections(session, gw.url)
            ended: dict[str, float] = {}
            watcher = asyncio.create_task(watch_end(session, gw.url, batch_id, t0, ended))
            with BusySampler(session, engines.urls, per_engine) as busy:
                outcomes = await open_loop(session, [gw.url], specs, args.duration, args.drain,
                                           auth=True)
            span = min(ended.get("at", args.duration), args.duration)
            watcher.cancel()
            summary = attainment(outcomes)
            # the gateway's rejections by band:reason (the batch band's are its lines')
            summary["shed_reasons"] = dict(sorted(
                (await rejections(session, gw.url) - shed0).items()))
            summary["fleet_utilisation"] = busy.mean
            if batch_id is not None:
                state = await batch_state(session, gw.url, batch_id)
                tokens = await batch_tokens(session, gw.url) - tokens0
                done = state["request_counts"]["completed"]
                res["batch"] = {"id": batch_id, "status": state["status"],
                                "lines": args.batch_lines, "completed": done,
                                "failed": state["request_counts"]["failed"],
                                "lines_per_s": round(done / span, 3),
                                "output_tokens_per_s": round(tokens / span, 2),
                                "ran_s": round(span, 1)}
            with (out_dir / f"{name}.jsonl").open("w") as f:
                for o in outcomes:
                    f.write(json.dumps(o.__dict__) + "\n")
        key = "online_with_batch" if with_batch else "online_alone"
        res[key] = summary
        print(f"{name}: {json.dumps(summary)} {json.dumps(res.get('batch'))}",
              file=sys.stderr, flush=True)
    alone, with_b = res["online_alone"], res["online_with_batch"]
    mean_out = alone["output_tokens"] / max(1, alone["requests"] - alone["rejected"])
    cap_tokens = capacity * mean_out
    online_tokens = with_b["output_tokens"] / args.duration
    spare = cap_tokens - online_tokens
    res["capacity_output_tokens_per_s"] = round(cap_tokens, 2)
    res["spare_capacity_used"] = round(res["batch"]["output_tokens_per_s"] / spare, 3) \
        if spare > 0 else None
    res["fleet_utilisation_alone"] = alone["fleet_utilisation"]
    res["fleet_utilisation_with_batch"] = with_b["fleet_utilisation"]
    return res


async def run_restart(session: aiohttp.ClientSession, args: argparse.Namespace,
                      out_dir: Path, report: dict[str, Any]) -> dict[str, Any]:
    (out_dir / "restart-engines").mkdir(parents=True, exist_ok=True)
    engines = Engines(args.engines, args.profile, args.restart_speed, out_dir / "restart-engines",
                      ENGINE_EXTRA)
    try:
        await engines.wait_ready(session)
        cfg = bench_config(out_dir / "restart", engines.urls, args, report)
        n = args.restart_lines
        with gateway(cfg, log_path=out_dir / "restart-1.log", ready_timeout_s=60) as gw:
            batch_id = await submit(session, gw.url, batch_file(n, args, args.seed + 91))
            while (await batch_state(session, gw.url, batch_id))["request_counts"][
                    "completed"] < n // 2:
                await asyncio.sleep(0.2)
            killed_at = (await batch_state(session, gw.url, batch_id))["request_counts"]
            _sigkill(gw)
        started = time.perf_counter()
        with gateway(cfg, log_path=out_dir / "restart-2.log", ready_timeout_s=60) as gw:
            while (state := await batch_state(session, gw.url, batch_id))["status"] in (
                    "in_progress", "cancelling"):
                await asyncio.sleep(0.5)
            ids: list[str] = []
            for fid in (state["output_file_id"], state["error_file_id"]):
                if fid:
                    async with session.get(f"{gw.url}/v1/files/{fid}/content",
                                           headers=_auth()) as r:
                        ids += [json.loads(x)["custom_id"] for x in (await r.text()).splitlines()]
        expected = {f"line-{i}" for i in range(n)}
        return {"lines": n, "killed_at_completed": killed_at["completed"],
                "status": state["status"], "completed": state["request_counts"]["completed"],
                "finished_after_restart_s": round(time.perf_counter() - started, 1),
                "lost": len(expected - set(ids)), "duplicated": len(ids) - len(set(ids))}
    finally:
        engines.stop()


def _commit() -> str | None:
    """The checkout's commit (and ``+dirty`` with uncommitted changes), for the report."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _sigkill(gw: RunningGateway) -> None:
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"commit": _commit(), "started": time.strftime(
                                  "%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "config": {"changed": {}, "engines": args.engines,
                                         "duration_s": args.duration,
                                         "batch_lines": args.batch_lines}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        engines = Engines(args.engines, args.profile, args.speed, out_dir, ENGINE_EXTRA)
        try:
            await engines.wait_ready(session)
            cap = await probe(session, engines, args, args.seed + 100) \
                if args.capacity is None else {"requests_per_s": args.capacity,
                                               "per_engine": args.per_engine, "given": True}
            report["capacity"] = cap
            for load in args.loads:
                report[f"load_{load:g}x"] = await run_load(
                    session, engines, args, load, cap["requests_per_s"], cap["per_engine"],
                    out_dir, report)
        finally:
            engines.stop()
        if not args.no_restart:
            report["restart"] = await run_restart(session, args, out_dir, report)
    report["goals"] = goals(report, args)
    return report


def goals(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in args.loads:
        r = report[f"load_{load:g}x"]
        alone = r["online_alone"]["slo_attainment"] or 0.0
        with_b = r["online_with_batch"]["slo_attainment"] or 0.0
        out[f"attainment_with_batch_{load:g}x"] = {
            "value": round(with_b / alone, 4) if alone else None, "goal": ">= 0.99",
            "met": alone > 0 and with_b >= 0.99 * alone}
        used = r["spare_capacity_used"]
        out[f"spare_capacity_used_{load:g}x"] = {"value": used, "goal": ">= 0.8",
                                                 "met": used is not None and used >= 0.8}
    if 0.5 in args.loads:
        u = report["load_0.5x"]["fleet_utilisation_with_batch"]
        out["utilisation_0.5x"] = {"value": u, "goal": ">= 0.85", "met": u is not None and u >= 0.85}
    if "restart" in report:
        r = report["restart"]
        out["restart"] = {"value": {"lost": r["lost"], "duplicated": r["duplicated"]},
                          "goal": "0 and 0", "met": r["lost"] == 0 and r["duplicated"] == 0}
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [f"capacity: {report['capacity']['requests_per_s']:.2f} req/s "
             f"(b = {report['capacity']['per_engine']} per engine)"]
    for key, r in report.items():
        if key.startswith("load_"):
            b = r["batch"]
            lines.append(
                f"{key}: online attainment alone {r['online_alone']['slo_attainment']} / with "
                f"batch {r['online_with_batch']['slo_attainment']}; batch {b['completed']} lines "
                f"({b['lines_per_s']}/s); spare used {r['spare_capacity_used']}; utilisation "
                f"{r['fleet_utilisation_alone']} -> {r['fleet_utilisation_with_batch']}")
    if "restart" in report:
        lines.append(f"restart: {report['restart']}")
    for name, g in report["goals"].items():
        lines.append(f"goal {name}: {g['value']} (goal {g['goal']}) "
                     f"{'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest batch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--out-dir", default="out/batch", help="logs, configs, per-request lines")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="cpu-gemma3-270m-quiet")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8],
                   help="online load, × the probed capacity")
    p.add_argument("--duration", type=float, default=300.0, help="send window per run, s")
    p.add_argument("--drain", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--batch-lines", type=int, default=3000)
    p.add_argument("--restart-lines", type=int, default=400)
    p.add_argument("--restart-speed", type=float, default=10.0,
                   help="the restart run's engines' speed (it measures lines kept, not time)")
    p.add_argument("--no-restart", action="store_true")
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--probe-batches", type=int, nargs="+", default=[4, 6, 8, 10])
    p.add_argument("--probe-duration", type=float, default=30.0)
    p.add_argument("--probe-warmup", type=float, default=10.0)
    p.add_argument("--queue-max", type=int, default=256)
    p.add_argument("--interactive-wait", type=float, default=0.7)
    p.add_argument("--standard-wait", type=float, default=0.5)
    p.add_argument("--batch-wait", type=float, default=0.5)
    p.add_argument("--capacity", type=float, help="req/s: skip the probe (with --per-engine)")
    p.add_argument("--per-engine", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="iteration run: 40 s windows, 300-line batch, 100-line restart, "
                   "15 s probes; not the benchmark")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.batch_lines, args.restart_lines = 40.0, 300, 100
        args.probe_batches, args.probe_duration, args.probe_warmup = [6, 8, 10], 15.0, 5.0
        args.warmup_s = 10.0
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0
