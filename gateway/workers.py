"""``sluice serve --workers N``: N gateway processes on one port.

The parent process serves nothing itself. It starts worker 0, which launches and
supervises the engines exactly as a single gateway does and writes their addresses to
a file (:mod:`engines.addresses`); then workers 1…N-1, which read that file and
treat the launched engines like ``external`` ones (health probes, metrics scrape,
KV-event subscription, so every worker has the same prefix view). Every worker binds
the port with ``SO_REUSEPORT`` and the kernel spreads connections across them.

What is shared: rate limits and concurrency slots when ``limits.store_url`` is Redis
(:func:`check_sharing` refuses several workers with tenant quotas on ``memory://``,
since each worker would enforce its own copy); response-cache entries when
``cache.store_url`` is Redis; the engines' own load (scraped by every worker) and their
KV-cache contents (events). What stays per worker: admission queues, each worker's
count of its own requests in flight on an engine, the prefix index's "predicted on
route" entries (until the engine's events confirm them), the sticky-session table,
the adaptive latency models, the semantic cache's vectors, ``/metrics``
(``metrics_listen`` port + worker index).

Lifecycle: SIGHUP to the parent is passed to every worker (each reloads its files).
SIGINT/SIGTERM to the parent stops workers 1…N-1 first (each drains its
requests), then worker 0 (drains, then stops the engines). A worker that exits on its
own stops the whole group the same way and the parent exits with status 1 — restart
it with the process manager that started ``sluice serve``. A worker whose parent is
gone (killed) stops itself, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from config.schema import Config
from gateway.internal import internal_secret

log = logging.getLogger(__name__)

#: How often, s, the parent checks its workers and a worker checks its parent.
POLL_S = 0.2
#: Extra time, s, a worker gets past its configured drain and stop grace to exit.
EXIT_MARGIN_S = 10.0


@dataclass(frozen=True)
class WorkerRole:
    """This process's place among ``count`` workers: ``index`` 0 owns the engines;
    ``address_file`` is where their addresses are written (by 0) and read (by the
    others); ``parent_pid`` is the process that started the workers."""

    index: int
    count: int
    address_file: Path
    parent_pid: int

    @property
    def owns_engines(self) -> bool:
        return self.index == 0


def check_sharing(cfg: Config, workers: int) -> list[str]:
    """What ``workers`` processes of ``cfg`` keep per process (one line each), for
    the start-up log.

    Raises:
        ValueError: several workers, limits on ``memory://`` and a tenant with a
            requests/min, tokens/min or concurrency quota: each worker would enforce
            its own copy, so a tenant would get up to ``workers`` times its quota.
    """
    if workers <= 1:
        return []
    tenants = [*cfg.tenants.tenants, *([cfg.tenants.anonymous] if cfg.tenants.allow_anonymous else [])]
    limited = [t.name for t in tenants if (t.requests_per_min, t.tokens_per_min,
                                           t.max_concurrent) != (None, None, None)]
    notes = ["admission queues, the requests each worker has in flight on an engine, "
             "routes not yet confirmed by KV events, sticky sessions and the learned "
             "latency models are per worker; engine load and KV-cache contents are read "
             "from the engines by every worker"]
    if cfg.gateway.limits.store_url.startswith("memory://"):
        if limited:
            raise ValueError(
                f"--workers {workers} with limits.store_url memory:// would give every "
                f"worker its own copy of the quotas of {limited} (up to {workers} times "
                "each): set limits.store_url to redis://… in gateway.yaml")
        notes.append("limits.store_url is memory://: no tenant has a quota now, but one "
                     "added by a tenants.yaml reload would be enforced per worker")
    if cfg.gateway.cache.enabled and cfg.gateway.cache.store_url.startswith("memory://"):
        notes.append("cache.store_url is memory://: each worker caches its own answers")
    return notes


async def watch_parent(role: WorkerRole, stop: asyncio.Event) -> None:
    """Set ``stop`` when the parent process is gone (this worker was re-parented)."""
    while os.getppid() == role.parent_pid:
        await asyncio.sleep(1.0)
    log.warning("worker %d: parent %d is gone; stopping", role.index, role.parent_pid)
    stop.set()


def run_workers(cfg: Config, serve_args: list[str], workers: int, *,
                drain_grace_s: float, stop_grace_s: float) -> int:
    """Start ``workers`` worker processes (``sluice serve`` + ``serve_args`` + their
    role) and supervise them until SIGINT/SIGTERM or until one exits.

    Args:
        cfg: the loaded configuration (checked with :func:`check_sharing`).
        serve_args: the ``serve`` arguments every worker gets (config files, host,
            port).
        workers: how many, ≥ 2.
        drain_grace_s: the gateway's drain grace, s (a worker's exit deadline).
        stop_grace_s: the engines' stop grace, s (worker 0's exit deadline).

    Returns:
        The exit status: 0 after a signal with every worker exited cleanly, else 1.
    """
    internal_secret()  # the workers inherit one secret for their batch lines
    try:
        for note in check_sharing(cfg, workers):
            log.warning("--workers %d: %s", workers, note)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs: list[subprocess.Popen[bytes]] = []

    def reload(*_: object) -> None:
        """SIGHUP: every worker reloads its files (without this handler SIGHUP's
        default action would end the parent, and with it the group)."""
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGHUP, reload)
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-workers-"))
    address_file = run_dir / "engines.json"

    def spawn(index: int) -> None:
        argv = [sys.executable, "-m", "gateway.cli", "serve", *serve_args,
                "--workers", str(workers), "--worker-index", str(index),
                "--address-file", str(address_file)]
        # own process group: a terminal's Ctrl-C reaches the parent only, which
        # stops the workers in order
        procs.append(subprocess.Popen(argv, process_group=0))

    def wait_tick() -> bool:
        """Sleep one tick; False once a signal came or a worker exited."""
        return not stop.wait(POLL_S) and all(p.poll() is None for p in procs)

    failed = False
    try:
        spawn(0)
        while not address_file.exists() and wait_tick():
            pass
        if address_file.exists() and not stop.is_set():
            for index in range(1, workers):
                spawn(index)
            log.info("%d workers: pids %s", workers, [p.pid for p in procs])
            while wait_tick():
                pass
        failed = any(p.poll() is not None for p in procs)
        if failed:
            log.error("a worker exited (%s); stopping the others",
                      {p.pid: p.returncode for p in procs if p.returncode is not None})
    finally:
        # the engines' owner last, so the others' requests to its engines finish
        statuses = _stop(procs[1:], drain_grace_s + EXIT_MARGIN_S)
        statuses += _stop(procs[:1], 2 * drain_grace_s + stop_grace_s + EXIT_MARGIN_S)
        address_file.unlink(missing_ok=True)
        run_dir.rmdir()
    return 1 if failed or any(statuses) else 0


def _stop(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """SIGTERM each of ``procs``, wait up to ``timeout_s`` s, SIGKILL the rest.
    Returns their exit statuses."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    statuses = []
    for p in procs:
        try:
            statuses.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            log.error("worker %d did not exit in %.0fs; killing it", p.pid, timeout_s)
            p.kill()
            statuses.append(p.wait())
    return statuses
