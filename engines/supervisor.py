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
import shutil
import tempfile
from collections.abc import Callable, Mapping
from hashlib import blake2b
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


def private_socket_dir() -> Path:
    """A new folder only this user may enter (mode 0700, :func:`tempfile.mkdtemp`)
    for the engines' KV-event sockets, in the temporary folder (``$TMPDIR``, else
    ``/tmp``): a Unix socket path must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix="sluice-kv-"))


def kv_events_flag(engine_id: str, sock_dir: Path) -> tuple[EventsEndpoint, list[str]]:
    """vLLM's ``--kv-events-config`` for a launched engine: its PUB and replay sockets
    are ``ipc://`` files in ``sock_dir`` (a private folder,
    :func:`private_socket_dir`), topic ``kv@<id>``.

    Why not TCP: the events carry every stored block's token ids, i.e. the tenants'
    prompts, and vLLM's publisher binds a PUB endpoint only when it is a wildcard
    (``tcp://*:port``, every interface, no authentication) or ``ipc://``
    (``ZmqEventPublisher._is_bind_endpoint``; it *connects to* any other TCP
    address). An ``ipc://`` socket in a 0700 folder is reachable by this user alone
    and never by the network. Returns the endpoint the gateway subscribes to (the same
    ``ipc://`` paths) and the flag's two arguments."""
    stem = sock_dir / blake2b(engine_id.encode(), digest_size=6).hexdigest()
    pub, replay = f"ipc://{stem}.pub", f"ipc://{stem}.replay"
    topic = f"kv@{engine_id}"
    flag = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": pub, "replay_endpoint": replay,
                       "buffer_steps": REPLAY_BUFFER_STEPS, "topic": topic})
    return EventsEndpoint(pub, replay, topic), ["--kv-events-config", flag]


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
    """Launches, watches and stops the engines of ``cfg``; :meth:`reconfigure` adds
    and retires engines while it runs.

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
        address_file: with ``launch``, where the engines' addresses are written
            whenever the launched engines change
            (:func:`engines.addresses.write_addresses`); without, where they are
            read. None: no file (one gateway process).
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
        #: every engine supervised, draining ones included until they are stopped
        self.runners: list[EngineRunner] = []
        #: the specs in effect, by name (a changed spec's new version is here while
        #: its old engines drain)
        self.specs: dict[str, EngineSpec] = {}
        self._launched: dict[str, list[EngineRunner]] = {}  # spec name -> its runners
        self._tasks: dict[EngineRunner, tuple[asyncio.Task, asyncio.Task]] = {}
        self._retiring: dict[str, asyncio.Task] = {}  # spec name -> drain, then relaunch
        self._taken: set[int] = set()  # ports in use or reserved
        self._ports: dict[EngineRunner, set[int]] = {}  # the ports each one took
        self._sock_dir: Path | None = None  # private folder of the KV-event sockets
        self._started = self._stopped = False

    @property
    def engines(self) -> list[Engine]:
        """The engines this supervisor runs, in configuration order (draining ones
        last, until they are stopped)."""
        return [r.engine for r in self.runners]

    def _check_commands(self, specs: list[EngineSpec]) -> None:
        unknown = {s.kind for s in specs if s.kind != "external"} - set(self.commands)
        if unknown:
            raise ValueError(f"no command to launch engine kind(s) {sorted(unknown)}")

    async def start(self) -> None:
        """Add every engine to the pool (state ``starting``), launch the processes and
        start the probe and metrics tasks. Returns at once; see :meth:`wait_ready`.

        Raises:
            RuntimeError: called twice.
            ValueError: a launched spec's ``kind`` has no command builder (nothing is
                added to the pool then).
            LookupError: not launching, and the address file lacks an engine.
            OSError: the address file cannot be read or written.
        """
        if self._started:
            raise RuntimeError("supervisor already started")
        self._check_commands(self.cfg.engines)
        self._started = True
        self.run_dir = self.run_dir or Path(
            os.environ.get("SLUICE_RUN_DIR") or tempfile.mkdtemp(prefix="sluice-run-")
        )
        self._taken = {s.port for s in self.cfg.engines if s.port is not None}
        for spec in self.cfg.engines:
            self.specs[spec.name] = spec
            self._launch(spec)
        log.info("%s %d engines; logs in %s", "supervising" if self.launch else "following",
                 len(self.runners), self.run_dir)

    def _launch(self, spec: EngineSpec) -> None:
        """Add ``spec``'s engines to the pool (``starting``: no traffic until a probe
        passes) and start their runner and metrics tasks. Not launching, a launched
        kind's engines are taken from the address file.

        Raises:
            LookupError: not launching, and the address file lacks one of them.
        """
        assert self.run_dir is not None
        sup = self.cfg.supervisor
        events = self.cfg.scheduler.prefix.source == "events"
        addresses = None
        if not self.launch and spec.kind != "external":
            assert self.address_file is not None
            addresses = read_addresses(self.address_file)
            missing = [i for i in engine_ids(spec) if i not in addresses]
            if missing:
                raise LookupError(f"{self.address_file} has no address for {missing}")
        command = None if spec.kind == "external" or addresses else self.commands[spec.kind]
        runners = self._launched[spec.name] = []
        for engine_id in engine_ids(spec):
            before = set(self._taken)
            if addresses:
                port, base_url = 0, addresses[engine_id].base_url
            elif command is None:
                port, base_url = 0, _external_base_url(str(spec.url))
            else:
                port = spec.port or choose_port(spec.host, spec.port_range, self._taken)
                self._taken.add(port)
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
            if addresses:
                engine.kv_events = addresses[engine_id].kv_events
            elif events and spec.kind in KV_EVENT_KINDS and not spec.pooling:
                if self._sock_dir is None:
                    self._sock_dir = private_socket_dir()
                engine.kv_events, extra = kv_events_flag(engine_id, self._sock_dir)
            elif events and spec.kv_events is not None:
                ev = spec.kv_events
                engine.kv_events = EventsEndpoint(ev.endpoint, ev.replay_endpoint, ev.topic)
            runner = EngineRunner(
                engine, spec, port, sup, self.pool, self.session, command=command,
                log_path=self.run_dir / f"{engine_id}.log",
                model_cache_dir=self.model_cache_dir, clock=self.clock, extra_args=extra,
            )
            runners.append(runner)
            self.runners.append(runner)
            self._ports[runner] = (self._taken - before) | {port}
            self.pool.add(engine)
        for runner in runners:
            poller = MetricsPoller(
                self.pool, runner.engine, self.session, interval_s=sup.metrics_interval_s,
                timeout_s=sup.probe_timeout_s, clock=self.clock,
                kind=KINDS[runner.spec.engine_dialect],
            )
            name = runner.engine.id
            self._tasks[runner] = (asyncio.create_task(runner.run(), name=f"run:{name}"),
                                   asyncio.create_task(poller.run(), name=f"metrics:{name}"))
        self._publish()

    def _publish(self) -> None:
        """Launching, with an address file: write every engine's address to it."""
        if self.launch and self.address_file is not None:
            write_addresses(self.address_file, self.engines)

    def _launch_when_known(self, spec: EngineSpec) -> None:
        """:meth:`_launch`, or (a follower whose address file does not name the new
        engines yet) wait for the launching process to publish them."""
        try:
            self._launch(spec)
        except LookupError:
            self._retiring[spec.name] = asyncio.create_task(
                self._await_addresses(spec), name=f"follow:{spec.name}")

    async def _await_addresses(self, spec: EngineSpec) -> None:
        """Re-read the address file every probe interval until it names ``spec``'s
        engines (then add them, if ``spec`` is still in effect), for at most
        ``supervisor.startup_grace_s``."""
        sup = self.cfg.supervisor
        deadline = self.clock.now() + sup.startup_grace_s
        while self.specs.get(spec.name) is spec and spec.name not in self._launched:
            try:
                self._launch(spec)
                break
            except LookupError as e:
                if self.clock.now() > deadline:
                    log.error("engines of %s not followed: %s", spec.name, e)
                    break
            await asyncio.sleep(sup.probe_interval_s)
        if self._retiring.get(spec.name) is asyncio.current_task():
            del self._retiring[spec.name]

    def reconfigure(self, specs: list[EngineSpec], grace_s: float) -> tuple[list[str], list[str]]:
        """Make the fleet run ``specs`` (a reloaded ``engines.yaml``), by spec name:

        * a new name: its engines join the pool ``starting`` and take traffic once a
          probe passes (launched kinds are started; ``external`` ones probed);
        * a name gone: its engines are marked ``draining`` at once (no new
          placement, retry or disaggregation leg: only ``ready`` engines are
          routable), their in-flight requests get up to ``grace_s`` seconds to
          finish, then launched processes are stopped (SIGTERM, SIGKILL after
          ``supervisor.stop_grace_s``) and the engines leave the pool
          (:attr:`EnginePool.on_remove`);
        * a changed spec (same name, any field different): the old engines drain and
          stop as above, then the new ones start under the same ids (a fixed
          ``port`` is free again by then; to replace an engine without a gap, add
          the new one under another name first).

        Synchronous: every state change above that applies now is made before it
        returns; draining and relaunching continue in the background.

        Returns:
            (names added or changed, names removed or changed), sorted.

        Raises:
            RuntimeError: before :meth:`start` or after :meth:`stop`.
            ValueError: a launched kind has no command builder (nothing changes).
        """
        if not self._started or self._stopped:
            raise RuntimeError("supervisor not running")
        self._check_commands(specs)
        wanted = {s.name: s for s in specs}
        gone = sorted(n for n, s in self.specs.items() if wanted.get(n) != s)
        new = sorted(n for n in wanted if self.specs.get(n) != wanted[n])
        self._taken.update(wanted[n].port for n in new if wanted[n].port is not None)
        for name in gone:
            del self.specs[name]
        for name in new:
            self.specs[name] = wanted[name]
        for name in sorted(set(gone) | set(new)):
            old = self._launched.pop(name, [])
            for runner in old:  # draining now: the runner must not mark it again
                self._tasks[runner][0].cancel()
                self.pool.set_state(runner.engine, EngineState.DRAINING)
            before = self._retiring.get(name)
            if not old and before is None:
                self._launch_when_known(wanted[name])
                continue
            self._retiring[name] = asyncio.create_task(
                self._replace(name, old, wanted.get(name), before, grace_s),
                name=f"replace:{name}")
        return new, gone

    async def _replace(self, name: str, old: list[EngineRunner], spec: EngineSpec | None,
                       before: asyncio.Task | None, grace_s: float) -> None:
        """Retire ``old`` (after ``before``, an earlier change of the same name), then
        launch ``spec`` if it is still the one in effect."""
        if before is not None:
            await asyncio.wait([before])
        await self._retire(old, grace_s)
        if spec is not None and self.specs.get(name) is spec and name not in self._launched:
            self._launch_when_known(spec)
        if self._retiring.get(name) is asyncio.current_task():
            del self._retiring[name]

    async def _retire(self, runners: list[EngineRunner], grace_s: float) -> None:
        """Drain ``runners`` (already ``draining``), stop their processes and take
        their engines out of the pool."""
        if not runners:
            return
        await _cancel([self._tasks[r][0] for r in runners])
        engines = [r.engine for r in runners]
        # With other workers (an address file), they route to the launched engines
        # too: their requests count only in the engine's own report, scraped after the
        # drain began (every worker marked the engine draining on the same reload).
        shared = {r.engine.id for r in runners if r.command is not None and self.address_file}
        since = self.clock.now()

        def drained(e: Engine) -> bool:
            if e.in_flight > 0:
                return False
            if e.id not in shared:
                return True
            m = e.metrics
            return m is not None and m.at > since and m.num_running + m.num_waiting == 0

        if not await wait_for(self.pool, lambda: all(drained(e) for e in engines), grace_s):
            log.warning("drain grace %.1fs over; stopping with requests in flight: %s",
                        grace_s, {e.id: e.in_flight or e.metrics and e.metrics.num_running
                                  for e in engines if not drained(e)})
        await asyncio.gather(*(r.stop_process(self.cfg.supervisor.stop_grace_s)
                               for r in runners))
        for runner in runners:
            self.pool.set_state(runner.engine, EngineState.STOPPED)
            self.pool.remove(runner.engine)
            self.runners.remove(runner)
            self._taken -= self._ports.pop(runner)
        self._publish()
        await _cancel([self._tasks.pop(r)[1] for r in runners])
        log.info("retired engines %s", [e.id for e in engines])

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

        Stops probing, restarting and any reconfiguration in progress, marks every
        engine ``draining`` (no new traffic), waits up to ``grace_s`` seconds for
        their in-flight requests to finish, then SIGTERMs each process group and
        SIGKILLs it after ``SupervisorConfig.stop_grace_s``. Ends with every engine
        ``stopped`` and the metrics pollers cancelled.
        """
        if self._stopped:
            return
        self._stopped = True
        await _cancel(list(self._retiring.values()))
        await _cancel([run for run, _ in self._tasks.values()])
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
        await _cancel([poll for _, poll in self._tasks.values()])
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for task, result in zip(tasks, results, strict=True):
        if isinstance(result, Exception):
            log.error("task %s failed: %r", task.get_name(), result)
