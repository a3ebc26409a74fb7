"""Reload ``tenants.yaml`` without a restart: on SIGHUP and when the file changes.

The watch is on the file's directory, not on the file: editors and ``mv`` replace the
file with a new one, and a Kubernetes ConfigMap volume swaps a ``..data`` symlink, so
a watch on the old file would see the first replacement and nothing after it. Any
change in the directory makes the reloader read what the name resolves to now; it
reloads when that path or the content's SHA-256 differs from the last one read.

A reload validates the whole file first; a bad file (including an empty one, as seen
while a file is being rewritten) keeps the running tenants, logs the error and is
recorded as ``result="error"``. Requests in flight keep the
:class:`~config.schema.TenantQuota` they were admitted with; new requests see the new
one. Settings in ``gateway.yaml`` and ``engines.yaml`` (ports, engines, stores) need
a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchfiles import awatch

from config.loader import ConfigError, load_file
from config.schema import TenantsConfig
from gateway.auth import TenantDirectory

log = logging.getLogger("sluice.reload")


@dataclass(frozen=True)
class ReloadEvent:
    """One reload attempt: wall-clock time (s since epoch), file, ``ok``/``error``."""

    at: float
    path: str
    result: str
    error: str | None = None


class TenantReloader:
    """Watches one tenants file and swaps it into a :class:`TenantDirectory`.

    ``history`` keeps the last 20 attempts (for the dashboard); ``on_result`` is
    called with each result (for metrics).
    """

    def __init__(self, path: Path, tenants: TenantDirectory,
                 on_result: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.tenants = tenants
        self.on_result = on_result
        self.history: deque[ReloadEvent] = deque(maxlen=20)
        self._seen = self._version()

    def _version(self) -> tuple[str, str] | None:
        """(the path the name resolves to, SHA-256 hex of its bytes), or None when the
        file cannot be read."""
        try:
            resolved = self.path.resolve()
            return str(resolved), hashlib.sha256(resolved.read_bytes()).hexdigest()
        except OSError:
            return None

    def reload(self) -> bool:
        """Load and swap; returns whether the new file took effect."""
        self._seen = self._version()
        try:
            cfg = load_file("tenants", self.path)
            assert isinstance(cfg, TenantsConfig)
        except ConfigError as e:
            log.error("tenants reload failed, keeping the running config: %s", e)
            self._record("error", str(e))
            return False
        self.tenants.replace(cfg)
        log.info("tenants reloaded from %s (%d tenants)", self.path, len(cfg.tenants))
        self._record("ok", None)
        return True

    def _record(self, result: str, error: str | None) -> None:
        self.history.append(ReloadEvent(time.time(), str(self.path), result, error))
        if self.on_result:
            self.on_result(result)

    async def run(self) -> None:
        """Reload on SIGHUP and on changes to the file (see the module docstring),
        until cancelled."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            async for _ in awatch(self.path.parent, watch_filter=None, recursive=False,
                                  debounce=200, step=50):
                if self._version() != self._seen:
                    self.reload()
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
