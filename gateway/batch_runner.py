"""Runs the lines of batches (docs/architecture.md, "Batches"): claims them from the
job store with expiring leases and sends each through this gateway's own request
pipeline, over loopback HTTP, as its tenant in the ``batch`` priority band — the same
authentication, quotas, cache, admission queue and placement as any online request.
The batch band is the least urgent: the admission queue places it only after every
waiting online ticket, sheds it first when full, and the placement keeps room for
the urgent bands (``BandDemand.urgent_free``), so lines run on the capacity online
traffic leaves free and stop being admitted the moment it needs that capacity.

Feeding (:meth:`BatchRunner.room`): a line is sent only while its model's engines
have room for it below their learned concurrency limits (the knee for the tightest
TPOT target, :func:`gateway.metrics.concurrency_limit`) less the places kept for the
online bands — ``BatchConfig.headroom`` of those limits, or more where
:meth:`limits.band_demand.BandDemand.urgent_free` asks for more —, one line per
engine on which an interactive request sent just after the line would still start
within its TTFT target (a batch line's prefill queues ahead of the next online request
on an FCFS engine: the prefills pending there, the line's and the request's own, each
the model's typical prompt, predicted as ``TTFT̂ + z σ``; before the engine's TTFT
fit is trusted, one with no prefill pending), and no online request is
waiting in the model's queue (the batch gives way at once); at most
``queued_lines`` batch tickets wait in the queue and ``max_in_flight`` lines run per
process. The admission each line then goes through decides, per engine, as for any
request of the band. A line answered 429 or 503 (shed, queue timeout, quota, no
engine) is handed back and retried after its ``Retry-After`` without counting as an
attempt; a 5xx or a failed connection counts, and after ``max_attempts`` the last
answer is its result; any other answer is its result at once.

Leases: renewed every ``lease_ttl_s / 3`` s while the process runs; released at a
clean shutdown (lines due again at once); a killed process's lines are claimed again
once its leases expire. Every second the runner also finalises due batches and
reads their progress (``/metrics``, the dashboard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from batch.store import Claimed, JobStore, Progress
from config.schema import PRIORITIES, BatchConfig, SloConfig
from engines.pool import Engine, EnginePool
from gateway.internal import INTERNAL_HEADER, TENANT_HEADER, internal_secret
from gateway.metrics import concurrency_limit
from gateway.placement import Placer
from limits.admission import AdmissionQueue
from limits.capacity import MixTracker
from limits.slo_gate import SloGate

log = logging.getLogger("sluice.batch")

#: Time constant of a batch's lines/s estimate, s.
RATE_TAU_S = 10.0
#: Active batches exported per series on ``/metrics`` (the oldest first): a bound on
#: the label values however many batches tenants create.
MAX_EXPORTED = 50
#: Retry-After assumed when a 429/503 carries none, s.
DEFAULT_RETRY_S = 1.0
#: A line sent less than this long ago (s) may not be in the queue or on an engine
#: yet: :meth:`BatchRunner.room` counts it as taking a place.
TRANSIT_S = 0.25
#: Uncached prompt tokens assumed of a request before the model's mix is observed.
DEFAULT_PROMPT_TOKENS = 512
#: Lines claimed per store round trip.
CLAIM_CHUNK = 16


@dataclass
class _Rate:
    """A batch's finished lines per second: an EWMA over progress readings."""

    done: int
    at: float
    per_s: float = 0.0

    def update(self, done: int, at: float) -> None:
        dt = at - self.at
        if dt <= 0:
            return
        inst = max(0, done - self.done) / dt
        alpha = 1 - pow(2.718281828, -dt / RATE_TAU_S)
        self.per_s += alpha * (inst - self.per_s)
        self.done, self.at = done, at


class BatchRunner:
    """Claims and runs batch lines in one gateway process.

    Args:
        store: the job store; None until it opens (set :attr:`store` then, before
            :meth:`start`).
        cfg: ``gateway.batch``.
        session: the app's client session (loopback requests).
        queues: the admission queues, ``{model: AdmissionQueue}`` (read for the
            depth of each band).
        pool: the engines (their learned limits and this process's requests on them).
        placer: the placement (its saturation thresholds), once the pipeline runs.
        slo: the bands' targets.
        mix: each model's observed request mix (the typical prompt), or None.
        gate: the SLO gate (the engines' latency ledgers and learned limits, the
            online bands' demand); None: adaptive admission's view is not read.
    """

    def __init__(self, store: JobStore | None, cfg: BatchConfig, session: aiohttp.ClientSession,
                 queues: dict[str, AdmissionQueue], pool: EnginePool,
                 placer: Placer | None, slo: SloConfig,
                 mix: dict[str, MixTracker] | None = None,
                 gate: SloGate | None = None) -> None:
        self.store: JobStore | None = store
        self.cfg, self.session, self.queues = cfg, session, queues
        self.pool, self.placer, self.slo, self.mix = pool, placer, slo, mix
        self.gate = gate
        self._tpot_s = min(slo.target(p).tpot_s for p in PRIORITIES)
        self._ttft_targets = {p: slo.target(p).ttft_s for p in PRIORITIES}
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.base_url: str | None = None
        self._buffer: deque[Claimed] = deque()
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        #: each running line's model and when it was sent (monotonic s)
        self._sent: dict[tuple[str, int], tuple[object, float]] = {}
        self._tenants: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.progress: list[Progress] = []
        self.rates: dict[str, _Rate] = {}
        #: lines ended by this process, per result (``ok``, ``failed``, ``retried``,
        #: ``dropped``: its lease was gone)
        self.results: dict[str, int] = {"ok": 0, "failed": 0, "retried": 0, "dropped": 0}

    def serve_at(self, base_url: str) -> None:
        """Start sending lines to this gateway at ``base_url`` (``http://host:port``,
        known once its socket is bound)."""
        self.base_url = base_url.rstrip("/")
        self._wake.set()

    def start(self) -> None:
        """Run :meth:`run` in a task of its own."""
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Stop :meth:`run` (idempotent): lines in flight are aborted, their leases
        handed back."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def _jobs(self) -> JobStore:
        assert self.store is not None, "the runner starts once its store is open"
        return self.store

    def poke(self) -> None:
        """Look for work now (a batch was created)."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    # ------------------------------------------------------------------ loops

    async def run(self) -> None:
        """Run until cancelled; then stop the lines in flight and hand back their
        leases."""
        house = asyncio.create_task(self._housekeeping())
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05 if self._buffer or self._tasks
                                               else self.cfg.poll_interval_s):
                        await self._wake.wait()
                self._wake.clear()
                if self.base_url is None:
                    continue
                try:
                    await self._fill()
                except Exception:  # noqa: BLE001 - the store is down: try again later
                    log.exception("batch runner: claiming lines failed")
                    await asyncio.sleep(self.cfg.poll_interval_s)
                self._launch()
        finally:
            house.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._jobs.release(self.owner)

    async def _housekeeping(self) -> None:
        """Renew leases every ``lease_ttl_s / 3``; finalise due batches and read
        progress every second."""
        renewed = time.monotonic()
        while True:
            try:
                if time.monotonic() - renewed >= self.cfg.lease_ttl_s / 3:
                    held = [*self._tasks, *((c.batch_id, c.idx) for c in self._buffer)]
                    await self._jobs.renew(self.owner, self.cfg.lease_ttl_s, held)
                    renewed = time.monotonic()
                await self._jobs.finalize_due()
                self._observe(await self._jobs.progress())
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("batch runner: housekeeping failed")
            await asyncio.sleep(min(1.0, self.cfg.lease_ttl_s / 3))

    def _observe(self, progress: list[Progress]) -> None:
        now = time.monotonic()
        for p in progress:
            finished = p.done + p.failed
            rate = self.rates.get(p.batch_id)
            if rate is None:
                self.rates[p.batch_id] = _Rate(finished, now)
            else:
                rate.update(finished, now)
        active = {p.batch_id for p in progress}
        for bid in [b for b in self.rates if b not in active]:
            del self.rates[bid]
        held = {c.batch_id for c in self._buffer} | {b for b, _ in self._tasks}
        for bid in [b for b in self._tenants if b not in active and b not in held]:
            del self._tenants[bid]
        self.progress = progress

    async def _fill(self) -> None:
        room = self.cfg.max_in_flight - len(self._tasks) - len(self._buffer)
        if len(self._buffer) >= CLAIM_CHUNK or room <= 0:
            return
        claimed = await self._jobs.claim(self.owner, min(CLAIM_CHUNK, room), self.cfg.lease_ttl_s)
        for line in claimed:
            if line.batch_id not in self._tenants:
                rec = await self._jobs.get_batch(None, line.batch_id)
                self._tenants[line.batch_id] = rec.tenant if rec else ""
        self._buffer.extend(claimed)

    def room(self, model: str) -> int:
        """Lines of ``model`` this process may send now: the engines' learned limits
        (an engine without one yet counts 1, so its model is learned before it is
        filled) less the places kept for online requests, less this process's
        requests on them, its batch tickets waiting and its lines sent in the last
        :data:`TRANSIT_S` (on their way); 0 while an online request
        waits, at most ``queued_lines`` more than the batch tickets waiting. A model
        nobody serves gets 1 (its line is answered 404)."""
        queue = self.queues.get(model)
        engines = [e for e in self.pool.for_model(model) if e.routable]
        if queue is None:
            return 1
        depth = queue.depth()
        if not engines or depth["interactive"] or depth["standard"]:
            return 0
        limits = [self._limit(e) for e in engines]
        places = sum(limits)
        keep = math.ceil(self.cfg.headroom * places)
        if self.gate is not None:
            keep = max(keep, self.gate.band_demand(model).urgent_free(
                "batch", places, self._ttft_targets))
        now = time.monotonic()
        transit = sum(1 for m, at in self._sent.values() if m == model and now - at < TRANSIT_S)
        free = places - keep - sum(e.in_flight for e in engines) - depth["batch"] - transit
        prompt = self._prompt_tokens(model)
        soon = [self._online_starts_after_a_line(e, prompt) for e in engines]
        starts = math.inf if None in soon else sum(map(bool, soon)) - depth["batch"] - transit
        return max(0, int(min(free, starts, self.cfg.queued_lines - depth["batch"] - transit)))

    def _prompt_tokens(self, model: str) -> int:
        """The model's mean uncached prompt, tokens (:class:`limits.capacity.Mix`), or
        :data:`DEFAULT_PROMPT_TOKENS` before any request finished."""
        mix = self.mix.get(model) if self.mix is not None else None
        seen = mix.mix() if mix is not None else None
        return round(seen.uncached_tokens) if seen is not None else DEFAULT_PROMPT_TOKENS

    def _online_starts_after_a_line(self, engine: Engine, prompt_tokens: int) -> bool | None:
        """Whether ``engine`` may take one more batch line: an interactive request of
        ``prompt_tokens`` sent right after a line of as many is predicted to start
        within the interactive TTFT target (:meth:`limits.slo_gate.SloGate.starts_after_one`;
        on an FCFS engine the line's prefill runs ahead of it); for an engine whose
        TTFT fit is not trusted yet, whether no prefill is pending there. None
        without adaptive admission: the concurrency limits alone decide."""
        if self.gate is None:
            return None
        return self.gate.starts_after_one(engine.id, prompt_tokens,
                                          self._ttft_targets["interactive"])

    def _limit(self, engine: Engine) -> int:
        """``engine``'s learned concurrency limit (:func:`concurrency_limit`); 1 until
        it has learned one (its slots are no limit the SLO allows). Without adaptive
        admission: ``saturation.max_in_flight``, else its slots, else
        ``batch.max_in_flight`` (the KV watermarks of the placement then decide)."""
        gate = self.gate
        if gate is not None and gate.tracks(engine.id):
            return 1 if gate.limit(engine.id, self._tpot_s) is None else \
                concurrency_limit(engine, self._tpot_s, gate) or 1
        cap = self.placer.detector.max_in_flight if self.placer is not None else None
        return cap or engine.slots or self.cfg.max_in_flight

    def _launch(self) -> None:
        """Send buffered lines while their model has :meth:`room` for them."""
        sent: dict[object, int] = {}
        kept: deque[Claimed] = deque()
        rooms: dict[object, int] = {}
        while self._buffer:
            line = self._buffer.popleft()
            model = line.body.get("model")
            if model not in rooms:
                rooms[model] = self.room(model) if isinstance(model, str) else 1
            if sent.get(model, 0) >= rooms[model]:
                kept.append(line)
                continue
            sent[model] = sent.get(model, 0) + 1
            key = (line.batch_id, line.idx)
            self._sent[key] = (model, time.monotonic())
            task = asyncio.create_task(self._run_line(line))
            self._tasks[key] = task
            task.add_done_callback(lambda _t, k=key: self._done(k))
        self._buffer = kept

    def _done(self, key: tuple[str, int]) -> None:
        self._tasks.pop(key, None)
        self._sent.pop(key, None)
        self._wake.set()

    # ------------------------------------------------------------------ one line

    async def _run_line(self, line: Claimed) -> None:
        try:
            await self._send(line)
        except Exception:  # noqa: BLE001 - its lease lapses and another try claims it
            log.exception("batch runner: line %s/%d failed", line.batch_id, line.idx)

    async def _send(self, line: Claimed) -> None:
        request_id = f"batch_req_{line.batch_id.split('_', 1)[-1]}_{line.idx}"
        headers = {INTERNAL_HEADER: internal_secret(),
                   TENANT_HEADER: self._tenants.get(line.batch_id, ""),
                   "x-request-id": request_id}
        try:
            # no client timeout: the gateway bounds the line (its queue wait, then the
            # engine's non-streaming timeout)
            async with self.session.post(f"{self.base_url}{line.url}", json=line.body,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=None)) as resp:
                raw = await resp.read()
                status, retry_after = resp.status, resp.headers.get("Retry-After")
        except aiohttp.ClientConnectionError:  # this gateway is stopping: not the line's fault
            await self._jobs.retry_later(self.owner, line, DEFAULT_RETRY_S, attempt=False)
            return
        except (aiohttp.ClientError, TimeoutError) as e:
            await self._failed_try(line, 502, {"error": {
                "message": f"the gateway could not run this request: {e}",
                "type": "server_error", "code": "upstream_error"}}, request_id)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"error": {"message": raw.decode(errors="replace")[:500],
                              "type": "server_error", "code": "upstream_error"}}
        if status in (429, 503):
            try:
                delay = float(retry_after) if retry_after else DEFAULT_RETRY_S
            except ValueError:
                delay = DEFAULT_RETRY_S
            self.results["retried"] += 1
            await self._jobs.retry_later(self.owner, line, delay, attempt=False)
            return
        if status >= 500:
            await self._failed_try(line, status, body, request_id)
            return
        usage = body.get("usage") if isinstance(body, dict) else None
        tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
        await self._finish(line, status, body, request_id, tokens or 0)

    async def _failed_try(self, line: Claimed, status: int, body: dict,
                          request_id: str) -> None:
        if line.attempts + 1 >= self.cfg.max_attempts:
            await self._finish(line, status, body, request_id, 0)
        else:
            self.results["retried"] += 1
            await self._jobs.retry_later(self.owner, line, DEFAULT_RETRY_S, attempt=True)

    async def _finish(self, line: Claimed, status: int, body: dict, request_id: str,
                      tokens: int) -> None:
        kept = await self._jobs.finish(self.owner, line, status, body, request_id, tokens)
        result = "dropped" if not kept else "ok" if 200 <= status < 300 else "failed"
        self.results[result] += 1

    # ------------------------------------------------------------------ views

    def panel(self) -> list[dict[str, object]]:
        """Active batches for the dashboard: id, tenant, status, done/total, failed,
        running, lines/s."""
        return [{"id": p.batch_id, "tenant": p.tenant, "status": p.status, "total": p.total,
                 "done": p.done, "failed": p.failed, "running": p.running,
                 "lines_per_s": round(self.rates[p.batch_id].per_s, 3)
                 if p.batch_id in self.rates else 0.0} for p in self.progress]


class BatchCollector(Collector):
    """``/metrics``: per active batch (the :data:`MAX_EXPORTED` oldest),
    ``sluice_batch_lines{batch,tenant,state}`` (``total``, ``done``, ``failed``,
    ``running``) and ``sluice_batch_lines_per_second{batch}``; this process's
    ``sluice_batch_lines_in_flight`` and ``sluice_batch_line_results_total{result}``."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lines = GaugeMetricFamily("sluice_batch_lines", "Lines of an active batch by state",
                                  labels=["batch", "tenant", "state"])
        rate = GaugeMetricFamily("sluice_batch_lines_per_second",
                                 "Lines an active batch finishes per second (EWMA, 10 s)",
                                 labels=["batch"])
        for row in self.runner.panel()[:MAX_EXPORTED]:
            for state in ("total", "done", "failed", "running"):
                lines.add_metric([str(row["id"]), str(row["tenant"]), state], float(row[state]))
            rate.add_metric([str(row["id"])], float(row["lines_per_s"]))
        yield lines
        yield rate
        yield GaugeMetricFamily("sluice_batch_lines_in_flight",
                                "Batch lines this process is running", value=self.runner.in_flight)
        results = CounterMetricFamily("sluice_batch_line_results",
                                      "Batch lines this process ended, by result", labels=["result"])
        for result, n in self.runner.results.items():
            results.add_metric([result], n)
        yield results
