"""The engine fleet's supervisor: one :class:`~engines.runner.EngineRunner` and one
:class:`~engines.metrics.MetricsPoller` task per engine, plus drain and stop.

The gateway creates it in ``cleanup_ctx`` with the shared ``ClientSession``, calls
:meth:`Supervisor.start` and, on shutdown, :meth:`Supervisor.stop`. With several gateway
processes (``sluice serve --workers N``) one supervisor launches the engines and
publishes their addresses (:mod:`engines.addresses`); the others follow that file and
only probe, scrape and route to the engines it names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from config.schema import EnginesConfig, EngineSpec
from engines.addresses import read_addresses, write_addresses
from engines.breaker import CircuitBreaker
from engines.kinds import KINDS
from engines.kv_events import EventsEndpoint
from engines.metrics import MetricsPoller
from engines.pool import Engine, EnginePool, EngineState
from engines.process import DEFAULT_COMMANDS, CommandBuilder, choose_port
from engines.runner import EngineRunner
from limits.clock import MONOTONIC
from limits.interfaces import Clock

log = logging.getLogger(__name__)


def engine_ids(spec: EngineSpec) -> list[str]:
    """Pool ids of a spec's processes: ``name`` alone, or ``name-0``… with replicas."""
    if spec.replicas == 1:
        return [spec.name]
    return [f"{spec.name}-{i}" for i in range(spec.replicas)]


def _external_base_url(url: str) -> str:
    base = url.rstrip("/")
    return base.removesuffix("/v1")


#: Batches an engine keeps for replay (vLLM's ``buffer_steps``, default 10,000). A
#: batch carries the token ids of every block stored in one step (~60 KB for a
#: 12k-token prompt), so vLLM's default could hold ~600 MB; 1,000 steps still cover
#: any gap a subscriber on the same host recovers from.
REPLAY_BUFFER_STEPS = 1000
#: Launched kinds that publish vLLM's KV-cache events with ``--kv-events-config``.
KV_EVENT_KINDS = frozenset({"vllm", "sim"})


def kv_events_flag(engine_id: str, host: str, taken: set[int]) -> tuple[EventsEndpoint, list[str]]:
    """vLLM's ``--kv-events-config`` for a launched engine on ``host``: a PUB and a
    replay port, free and not in ``taken`` (both added to it), topic ``kv@<id>``.
    The PUB endpoint is ``tcp://*:port`` because vLLM binds only wildcard TCP
    endpoints (``ZmqEventPublisher._is_bind_endpoint``) and connects to the rest.
    Returns the endpoint the gateway subscribes to and the flag's two arguments."""
    pub = choose_port(host, None, taken)
    taken.add(pub)
    replay = choose_port(host, None, taken)
    taken.add(replay)
    at = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    topic = f"kv@{engine_id}"
    flag = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://{at}:{replay}",
                       "buffer_steps": REPLAY_BUFFER_STEPS, "topic": topic})
    endpoint = EventsEndpoint(f"tcp://{at}:{pub}", f"tcp://{at}:{replay}", topic)
    return endpoint, ["--kv-events-config", flag]


async def wait_for(pool: EnginePool, predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Wait until ``predicate()`` is true, re-checking on every pool notification.
    Returns False if ``timeout_s`` seconds pass first."""
    changed = asyncio.Event()
    pool.listeners.append(changed.set)
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                changed.clear()
                await changed.wait()
        return True
    except TimeoutError:
        return False
    finally:
        pool.listeners.remove(changed.set)


class Supervisor:
    """Launches, watches and stops the engines of ``cfg``.

    Args:
        cfg: engines and supervisor timings.
        pool: receives one :class:`Engine` per process (or external URL).
        session: shared client session for probes and metrics (not closed here).
        model_cache_dir: where ``packaged:`` models are prepared (default
            :func:`engines.prepare.default_cache_dir`).
        clock: monotonic clock, s (grace periods, idleness, metrics timestamps).
        commands: command builder per launched ``kind`` (default
            :data:`engines.process.DEFAULT_COMMANDS`); tests inject their own.
        run_dir: folder for per-engine log files ``<engine id>.log``; default
            ``$SLUICE_RUN_DIR`` or a new temporary folder.
        launch: False in a gateway process that does not own the engines: every
            launched kind is then probed at the address ``address_file`` gives, like
            an ``external`` engine, and never started or stopped here.
        address_file: with ``launch``, where the engines' addresses are written once
            they are assigned (:func:`engines.addresses.write_addresses`); without,
            where they are read. None: no file (one gateway process).
    """

    def __init__(
        self,
        cfg: EnginesConfig,
        pool: EnginePool,
        session: aiohttp.ClientSession,
        *,
        model_cache_dir: Path | None = None,
        clock: Clock = MONOTONIC,
        commands: Mapping[str, CommandBuilder] = DEFAULT_COMMANDS,
        run_dir: Path | None = None,
        launch: bool = True,
        address_file: Path | None = None,
    ) -> None:
        if not launch and address_file is None:
            raise ValueError("a supervisor that does not launch needs an address file")
        self.cfg = cfg
        self.pool = pool
        self.session = session
        self.model_cache_dir = model_cache_dir
        self.clock = clock
        self.commands = commands
        self.run_dir = run_dir
        self.launch = launch
        self.address_file = address_file
        self.runners: list[EngineRunner] = []
        self._runner_tasks: list[asyncio.Task] = []
        self._poller_tasks: list[asyncio.Task] = []
        self._stopped = False

    @property
    def engines(self) -> list[Engine]:
        """The engines this supervisor created, in configuration order."""
        return [r.engine for r in self.runners]

    async def start(self) -> None:
        """Add every engine to the pool (state ``starting``), launch the processes and
        start the probe and metrics tasks. Returns at once; see :meth:`wait_ready`.

        Raises:
            RuntimeError: called twice.
            ValueError: a launched spec's ``kind`` has no command builder, or (not
                launching) the address file lacks one of its engines (nothing is added
                to the pool then).
            OSError: the address file cannot be read or written.
        """
        if self.runners:
            raise RuntimeError("supervisor already started")
        unknown = {s.kind for s in self.cfg.engines if s.kind != "external"} - set(self.commands)
        if unknown:
            raise ValueError(f"no command to launch engine kind(s) {sorted(unknown)}")
        addresses = None if self.launch else read_addresses(self.address_file)
        if addresses is not None:
            missing = {i for s in self.cfg.engines if s.kind != "external"
                       for i in engine_ids(s)} - set(addresses)
            if missing:
                raise ValueError(f"{self.address_file} has no address for {sorted(missing)}")
        run_dir = self.run_dir or Path(
            os.environ.get("SLUICE_RUN_DIR") or tempfile.mkdtemp(prefix="sluice-run-")
        )
        sup = self.cfg.supervisor
        events = self.cfg.scheduler.prefix.source == "events"
        taken: set[int] = {s.port for s in self.cfg.engines if s.port is not None}
        for spec in self.cfg.engines:
            launched = spec.kind != "external" and addresses is None
            command = self.commands[spec.kind] if launched else None
            for engine_id in engine_ids(spec):
                if spec.kind != "external" and addresses is not None:
                    port, base_url = 0, addresses[engine_id].base_url
                elif command is None:
                    port, base_url = 0, _external_base_url(str(spec.url))
                else:
                    port = spec.port or choose_port(spec.host, spec.port_range, taken)
                    taken.add(port)
                    base_url = f"http://{spec.host}:{port}"
                # open long enough for the runner's inference probe to decide first
                breaker = CircuitBreaker(failure_threshold=sup.failure_threshold,
                                         open_s=sup.probe_interval_s + sup.probe_timeout_s,
                                         clock=self.clock)
                engine = Engine(id=engine_id, model=spec.model, base_url=base_url,
                                breaker=breaker, labels={"spec": spec.name, "kind": spec.kind,
                                                         "role": spec.role,
                                                         "dialect": spec.engine_dialect},
                                priority_scheduling=spec.priority_scheduling,
                                cost_per_hour=spec.cost_per_hour)
                extra: list[str] = []
                if spec.kind != "external" and addresses is not None:
                    engine.kv_events = addresses[engine_id].kv_events
                elif events and spec.kind in KV_EVENT_KINDS:
                    engine.kv_events, extra = kv_events_flag(engine_id, spec.host, taken)
                elif events and spec.kv_events is not None:
                    ev = spec.kv_events
                    engine.kv_events = EventsEndpoint(ev.endpoint, ev.replay_endpoint, ev.topic)
                self.pool.add(engine)
                self.runners.append(EngineRunner(
                    engine, spec, port, sup, self.pool, self.session, command=command,
                    log_path=run_dir / f"{engine_id}.log",
                    model_cache_dir=self.model_cache_dir, clock=self.clock, extra_args=extra,
                ))
        for runner in self.runners:
            poller = MetricsPoller(
                self.pool, runner.engine, self.session, interval_s=sup.metrics_interval_s,
                timeout_s=sup.probe_timeout_s, clock=self.clock,
                kind=KINDS[runner.spec.engine_dialect],
            )
            name = runner.engine.id
            self._runner_tasks.append(asyncio.create_task(runner.run(), name=f"run:{name}"))
            self._poller_tasks.append(asyncio.create_task(poller.run(), name=f"metrics:{name}"))
        if self.launch and self.address_file is not None:
            write_addresses(self.address_file, self.engines)
        log.info("%s %d engines; logs in %s", "supervising" if self.launch else "following",
                 len(self.runners), run_dir)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every engine is ``ready``. Returns False after ``timeout_s``
        seconds, or as soon as an engine has been given up (``stopped``)."""
        engines = self.engines

        def settled() -> bool:
            return all(e.routable for e in engines) or any(
                e.state is EngineState.STOPPED for e in engines
            )

        return await wait_for(self.pool, settled, timeout_s) and all(
            e.routable for e in engines
        )

    async def stop(self, grace_s: float) -> None:
        """Drain and stop every engine; idempotent.

        Stops probing and restarting, marks every engine ``draining`` (no new
        traffic), waits up to ``grace_s`` seconds for their in-flight requests to
        finish, then SIGTERMs each process group and SIGKILLs it after
        ``SupervisorConfig.stop_grace_s``. Ends with every engine ``stopped`` and the
        metrics pollers cancelled.
        """
        if self._stopped:
            return
        self._stopped = True
        await _cancel(self._runner_tasks)
        for engine in self.engines:
            self.pool.set_state(engine, EngineState.DRAINING)
        idle = await wait_for(
            self.pool, lambda: all(e.in_flight <= 0 for e in self.engines), grace_s
        )
        if not idle:
            busy = {e.id: e.in_flight for e in self.engines if e.in_flight > 0}
            log.warning("drain grace %.1fs over; stopping with requests in flight: %s",
                        grace_s, busy)
        stop_grace = self.cfg.supervisor.stop_grace_s
        await asyncio.gather(*(r.stop_process(stop_grace) for r in self.runners))
        for engine in self.engines:
            self.pool.set_state(engine, EngineState.STOPPED)
        await _cancel(self._poller_tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for task, result in zip(tasks, results, strict=True):
        if isinstance(result, Exception):
            log.error("task %s failed: %r", task.get_name(), result)
