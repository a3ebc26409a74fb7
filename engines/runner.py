"""The life cycle of one engine: launch, probe, mark, restart (docs/architecture.md, "Engines").

:class:`EngineRunner.run` is one asyncio task per engine. States go through
:meth:`EnginePool.set_state` so listeners see every change:

* ``starting`` — launched, no traffic. Probed (``/health`` + ``/v1/models``) every
  ``probe_interval_s``; ``ready`` on the first success. Not ready within
  ``startup_grace_s`` → restart.
* ``ready`` — probed every ``probe_interval_s``; when no probe has seen a request
  of this gateway in flight on it for ``inference_probe_idle_s``, the probe adds a
  1-token completion (then again every ``inference_probe_idle_s`` while idle), and
  so does every probe while the engine's circuit breaker is not closed (the gateway
  opened it after ``failure_threshold`` requests in a row timed out before their
  first token or could not connect; :mod:`engines.breaker`). Each inference probe's
  outcome is recorded in the breaker: a success closes it. A failed probe does not
  count while the metrics show the engine busy and making progress
  (:func:`~engines.health.made_progress`).
  ``failure_threshold`` consecutive failures → ``unhealthy``.
* ``unhealthy`` — no traffic, still probed, always with a 1-token completion (its
  ``/health`` may answer while inference hangs): a success returns it to ``ready``;
  another ``failure_threshold`` failures → restart.
* ``restarting`` — the process group is killed; after the backoff
  (:func:`~engines.health.backoff_delay` of the consecutive-failure streak)
  ``restarts`` and ``generation`` are incremented and it is launched again. The
  streak resets once the engine has stayed ready for ``restart_backoff_max_s``; past
  ``max_restarts`` consecutive restarts the engine is ``stopped`` for good.

A process that exits is noticed at once (the runner awaits its exit alongside each
sleep and probe) and counts as a failure → ``unhealthy`` → ``restarting``.
``external`` engines have no process: they move between ``starting``/``ready`` and
``unhealthy`` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Sequence
from pathlib import Path

import aiohttp

from config.schema import EngineSpec, SupervisorConfig
from engines.breaker import BreakerState
from engines.health import backoff_delay, made_progress, probe_inference, probe_ready
from engines.kinds import KINDS
from engines.kinds.llamacpp import resolve_gguf
from engines.pool import Engine, EnginePool, EngineState
from engines.prepare import resolve_model_path
from engines.process import CommandBuilder, EngineProcess
from limits.interfaces import Clock

log = logging.getLogger(__name__)


class _Exited(Exception):
    """The engine process exited while the runner was waiting."""


class EngineRunner:
    """Runs one engine.

    Args:
        engine: the pool entry it drives (its ``base_url`` holds host and port).
        spec: the configuration entry it came from.
        port: the port the process must listen on (ignored for ``external``).
        cfg: probe and restart timings.
        pool: where states are written.
        session: shared client session for probes.
        command: builds the command line; None for ``external``.
        log_path: the process's stdout/stderr file.
        model_cache_dir: where ``packaged:`` models are prepared (None: default).
        clock: monotonic clock, s.
        extra_args: appended to the command line (the KV-event publisher flag).
    """

    def __init__(
        self,
        engine: Engine,
        spec: EngineSpec,
        port: int,
        cfg: SupervisorConfig,
        pool: EnginePool,
        session: aiohttp.ClientSession,
        *,
        command: CommandBuilder | None,
        log_path: Path,
        model_cache_dir: Path | None,
        clock: Clock,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.port = port
        self.cfg = cfg
        self.pool = pool
        self.session = session
        self.command = command
        self.log_path = log_path
        self.model_cache_dir = model_cache_dir
        self.clock = clock
        self.extra_args = list(extra_args)
        #: The process currently launched (None before the first launch).
        self.process: EngineProcess | None = None
        self._ready_at: float | None = None  # when the current process became ready

    async def run(self) -> None:
        """Drive the engine until cancelled (or, for a launched engine, until it
        exceeded ``max_restarts``)."""
        if self.command is None:
            await self._watch()
            return
        try:
            resolve = resolve_gguf if self.spec.kind == "llamacpp" else resolve_model_path
            model_path = (
                await asyncio.to_thread(resolve, self.spec.model_path, self.model_cache_dir)
                if self.spec.model_path else None
            )
        except (ImportError, OSError, ValueError) as e:
            log.error("engine %s: cannot prepare model %s: %s", self.engine.id,
                      self.spec.model_path, e)
            self.pool.set_state(self.engine, EngineState.STOPPED)
            return
        argv = [*self.command(self.spec, self.spec.host, self.port, model_path),
                *self.extra_args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.spec.env}
        streak = 0
        while True:
            reason, ready_for = await self._run_once(argv, env)
            streak = 1 if ready_for >= self.cfg.restart_backoff_max_s else streak + 1
            if streak > self.cfg.max_restarts:
                log.error("engine %s: %s; gave up after %d restarts", self.engine.id,
                          reason, streak - 1)
                self.pool.set_state(self.engine, EngineState.STOPPED)
                return
            delay = backoff_delay(streak, self.cfg.restart_backoff_s,
                                  self.cfg.restart_backoff_max_s)
            log.warning("engine %s: %s; restart %d in %.1fs", self.engine.id, reason,
                        streak, delay)
            self.pool.set_state(self.engine, EngineState.RESTARTING)
            await asyncio.sleep(delay)
            self.engine.restarts += 1
            self.engine.generation += 1

    async def _run_once(self, argv: list[str], env: dict[str, str]) -> tuple[str, float]:
        """Launch, watch until the process must go, kill it. Returns why it went and
        how long it had been ready, s."""
        self.process = EngineProcess(argv, env, self.log_path)
        self.pool.set_state(self.engine, EngineState.STARTING)
        try:
            await self.process.start()
        except OSError as e:
            self.pool.set_state(self.engine, EngineState.UNHEALTHY)
            return f"cannot launch: {e}", 0.0
        exited = asyncio.create_task(self.process.wait())
        self._ready_at = None
        try:
            reason = await self._watch(exited)
        except _Exited:
            reason = f"process exited with status {exited.result()}"
        finally:
            exited.cancel()
        self.pool.set_state(self.engine, EngineState.UNHEALTHY)
        self.process.kill()
        await self.process.wait()
        ready_for = self.clock.now() - self._ready_at if self._ready_at is not None else 0.0
        return reason, ready_for

    async def _race(self, aw: Awaitable[bool] | None, exited: asyncio.Task | None,
                    sleep_s: float = 0.0) -> bool:
        """Await ``aw`` (or sleep ``sleep_s``), raising :class:`_Exited` as soon as
        the process exits."""
        task = asyncio.ensure_future(aw if aw is not None else asyncio.sleep(sleep_s, True))
        waiting = {task} if exited is None else {task, exited}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            task.cancel()
        if exited is not None and exited.done():
            raise _Exited
        return task.result()

    async def _watch(self, exited: asyncio.Task | None = None) -> str:
        """Probe until the engine must be restarted; returns the reason. Returns only
        for launched engines (``exited`` given)."""
        cfg, engine = self.cfg, self.engine
        started = self.clock.now()
        failures = 0
        last_busy = started
        seen = engine.metrics
        while True:
            await self._race(None, exited, cfg.probe_interval_s)
            now = self.clock.now()
            if engine.state is EngineState.STARTING:
                if await self._race(self._probe(inference=False), exited):
                    self._ready_at = self.clock.now()
                    last_busy = self._ready_at
                    self.pool.set_state(engine, EngineState.READY)
                elif exited is not None and now - started > cfg.startup_grace_s:
                    return f"not ready within {cfg.startup_grace_s:.0f}s"
                continue
            if engine.in_flight > 0:
                last_busy = now
            # an unhealthy engine must answer a real 1-token completion to come back
            # (its /health may answer while inference hangs)
            # ... and so must one whose breaker the gateway's failed requests opened
            inference = (engine.state is EngineState.UNHEALTHY
                         or engine.breaker.state is not BreakerState.CLOSED
                         or now - last_busy >= cfg.inference_probe_idle_s)
            ok = await self._race(self._probe(inference), exited)
            if inference:
                last_busy = self.clock.now()
                engine.breaker.record(ok)
                self.pool.notify()  # a closed breaker makes the engine routable again
            ok = ok or made_progress(seen, engine.metrics, self.clock.now(), cfg.metrics_stale_s)
            seen = engine.metrics
            if ok:
                failures = 0
                if engine.state is EngineState.UNHEALTHY:
                    self.pool.set_state(engine, EngineState.READY)
                continue
            failures += 1
            if failures == cfg.failure_threshold:
                log.warning("engine %s: %d failed probes; unhealthy", engine.id, failures)
                self.pool.set_state(engine, EngineState.UNHEALTHY)
            elif failures >= 2 * cfg.failure_threshold and exited is not None:
                return f"unhealthy for {failures} probes"

    async def _probe(self, inference: bool) -> bool:
        """``/health`` (+ ``/v1/models``), then, if ``inference``, a 1-token completion
        as well: both must pass."""
        args = (self.session, self.engine.base_url, self.engine.model, self.cfg.probe_timeout_s)
        kind = KINDS[self.spec.engine_dialect]
        return await probe_ready(*args, kind.health_path) and (
            not inference or await probe_inference(
                *args, "embeddings" if self.spec.pooling else kind.probe_endpoint))

    async def stop_process(self, grace_s: float) -> None:
        """SIGTERM the current process group, SIGKILL after ``grace_s`` seconds.
        Call after the :meth:`run` task was cancelled."""
        if self.process is not None:
            await self.process.stop(grace_s)
