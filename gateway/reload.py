"""Reload ``tenants.yaml`` and ``engines.yaml`` without a restart: on SIGHUP and when
a file changes.

The watch is on each file's directory, not on the file: editors and ``mv`` replace
the file with a new one, and a Kubernetes ConfigMap volume swaps a ``..data``
symlink, so a watch on the old file would see the first replacement and nothing
after it. A change in a watched directory to a watched name, to the file a watched
name links to, or to a ``..`` entry (the ConfigMap's link and folders) makes the
reloader read what each name resolves to now (other files there, such as a log
written next to the config, do not wake it); it reloads a file when that path or the
content's SHA-256 differs from the last one read. SIGHUP reloads every watched file.

A reload validates the whole file first; a bad file (including an empty one, as seen
while a file is being rewritten) keeps the running configuration, logs the error and
is recorded as ``result="error"`` (``sluice_config_reloads_total``, the dashboard's
reload history). What a valid file changes:

* ``tenants.yaml``: everything. Requests in flight keep the
  :class:`~config.schema.TenantQuota` they were admitted with; new requests see the
  new one.
* ``engines.yaml``: the fleet (``engines``: added engines start and take traffic
  once healthy, removed ones drain and stop — :meth:`engines.supervisor.Supervisor.reconfigure`),
  ``models`` (degradation), the scheduler's ``filters``, ``scorers`` and
  ``picker``, and ``saturation`` (but ``saturation.adaptive``). The sections in
  :data:`RESTART_SECTIONS` keep their running values until a restart, and a reload
  that changes them logs a warning naming them. The file must also pass the checks
  across files that start-up makes (a tenant's allowed model, a fallback model, must
  be served).

Settings in ``gateway.yaml`` (ports, stores, timeouts) need a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchfiles import awatch

from config.loader import ConfigError, load_file
from config.schema import EnginesConfig

log = logging.getLogger("sluice.reload")

#: ``engines.yaml`` sections a reload does not change: the prefix index, session
#: table, supervisor timings, latency models and split policy are built once, at
#: start-up, from these.
RESTART_SECTIONS = ("scheduler.prefix", "scheduler.sessions", "supervisor",
                    "saturation.adaptive", "disaggregation")


def reloadable_engines(running: EnginesConfig,
                       new: EnginesConfig) -> tuple[EnginesConfig, list[str]]:
    """What a reload of ``engines.yaml`` applies: ``new`` with the
    :data:`RESTART_SECTIONS` kept as ``running`` has them, and the names of those
    sections whose value in ``new`` differs (they take effect on a restart)."""
    def get(cfg: EnginesConfig, dotted: str) -> Any:
        out: Any = cfg
        for part in dotted.split("."):
            out = getattr(out, part)
        return out

    pending = [s for s in RESTART_SECTIONS if get(running, s) != get(new, s)]
    applied = new.model_copy(update={
        "supervisor": running.supervisor,
        "disaggregation": running.disaggregation,
        "scheduler": new.scheduler.model_copy(update={
            "prefix": running.scheduler.prefix, "sessions": running.scheduler.sessions}),
        "saturation": new.saturation.model_copy(update={
            "adaptive": running.saturation.adaptive}),
    })
    return applied, pending


@dataclass(frozen=True)
class ReloadEvent:
    """One reload attempt: wall-clock time (s since epoch), file, ``ok``/``error``."""

    at: float
    path: str
    result: str
    error: str | None = None


@dataclass
class WatchedFile:
    """One configuration file: its ``kind`` (``tenants``, ``engines``), ``path``, and
    ``apply``, called with the validated file; it may refuse it by raising
    :class:`~config.loader.ConfigError` (nothing may have changed then)."""

    kind: str
    path: Path
    apply: Callable[[Any], None]
    seen: tuple[str, str] | None = None

    def version(self) -> tuple[str, str] | None:
        """(the path the name resolves to, SHA-256 hex of its bytes), or None when
        the file cannot be read."""
        try:
            resolved = self.path.resolve()
            return str(resolved), hashlib.sha256(resolved.read_bytes()).hexdigest()
        except OSError:
            return None


class ConfigReloader:
    """Watches configuration files and applies each valid change.

    Args:
        files: what to watch, by kind: ``{kind: (path, apply)}`` (see
            :class:`WatchedFile`).
        on_result: called with each result, ``ok`` or ``error`` (metrics).

    ``history`` keeps the last 20 attempts over all files (for the dashboard).
    """

    def __init__(self, files: Mapping[str, tuple[Path, Callable[[Any], None]]],
                 on_result: Callable[[str], None] | None = None) -> None:
        self.files = {kind: WatchedFile(kind, path, apply) for kind, (path, apply) in files.items()}
        for f in self.files.values():
            f.seen = f.version()
        self.on_result = on_result
        self.history: deque[ReloadEvent] = deque(maxlen=20)

    def reload(self, kind: str | None = None) -> bool:
        """Load and apply the file of ``kind`` (None: every file); returns whether
        all of them took effect."""
        return all([self._reload(f) for f in self.files.values() if kind in (None, f.kind)])

    def _reload(self, f: WatchedFile) -> bool:
        f.seen = f.version()
        try:
            f.apply(load_file(f.kind, f.path))
        except ConfigError as e:
            log.error("%s reload failed, keeping the running config: %s", f.kind, e)
            self._record(f, "error", str(e))
            return False
        log.info("%s reloaded from %s", f.kind, f.path)
        self._record(f, "ok", None)
        return True

    def _record(self, f: WatchedFile, result: str, error: str | None) -> None:
        self.history.append(ReloadEvent(time.time(), str(f.path), result, error))
        if self.on_result:
            self.on_result(result)

    def concerns(self, change: Any, path: str) -> bool:
        """Whether a change to the entry ``path`` in a watched folder may change a
        watched file (module docstring)."""
        name = Path(path).name
        if name.startswith(".."):
            return True
        return any(name in (f.path.name, os.path.basename(os.path.realpath(f.path)))
                   for f in self.files.values())

    async def run(self) -> None:
        """Reload on SIGHUP and on changes to the files (see the module docstring),
        until cancelled."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        folders = dict.fromkeys(f.path.parent for f in self.files.values())
        try:
            async for _ in awatch(*folders, watch_filter=self.concerns, recursive=False,
                                  debounce=200, step=50):
                for f in self.files.values():
                    if f.version() != f.seen:
                        self._reload(f)
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
