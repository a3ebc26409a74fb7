"""Scrape an engine's load metrics into a :class:`MetricsSnapshot`.

:class:`MetricsPoller` is the per-engine I/O loop that scrapes on an interval, parses
the page with the engine's dialect (:mod:`engines.kinds`; vLLM's page:
:func:`engines.kinds.vllm.parse_metrics`) and stores each snapshot with
:meth:`EnginePool.set_metrics`.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from engines.kinds import KINDS, SIGNALS, EngineKind
from engines.pool import Engine, EnginePool, MetricsSnapshot
from limits.clock import MONOTONIC
from limits.interfaces import Clock

log = logging.getLogger(__name__)

class MetricsPoller:
    """Scrapes one engine's ``/metrics`` every ``interval_s`` and stores the snapshot
    in the pool.

    A failed scrape (connection refused, timeout, non-200, unparsable text) keeps the
    previous snapshot; consumers judge freshness by ``snapshot.at`` against
    ``SupervisorConfig.metrics_stale_s``. The engine's ``base_url`` is read on every
    scrape, so it may change across restarts.

    The endpoint and its parser are the engine's dialect's (``kind``, default vLLM's).
    An endpoint that answers 404, or a page holding none of the known signals, marks
    the engine unmetered (``Engine.metered``: admitted by the gateway's own accounting,
    ``limits.saturation``); a dialect
    without an endpoint is unmetered from the start and never scraped. Whenever the
    signals read differ from the dialect's full set, one log line names the missing ones.
    A dialect with a slot-count endpoint (``kind.slots_path``: llama.cpp's ``/props``)
    has it read once per engine generation (a restart may change it) into
    ``Engine.slots``.

    Args:
        pool: where snapshots are stored (:meth:`EnginePool.set_metrics`).
        engine: the engine to scrape.
        session: the shared client session (not closed here).
        interval_s: time between the starts of two scrapes, s
            (``SupervisorConfig.metrics_interval_s``).
        timeout_s: limit of one scrape, s (``SupervisorConfig.probe_timeout_s``).
        clock: monotonic clock giving ``snapshot.at``, s.
        kind: the engine's dialect (default :data:`engines.kinds.vllm.KIND`).
    """

    def __init__(
        self,
        pool: EnginePool,
        engine: Engine,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        timeout_s: float,
        clock: Clock = MONOTONIC,
        kind: EngineKind | None = None,
    ) -> None:
        self.kind = kind or KINDS["vllm"]
        self._reported: frozenset[str] | None = None  # signals last logged
        self._slots_generation: int | None = None  # engine generation slots were read for
        self.pool = pool
        self.engine = engine
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.clock = clock

    def _signals(self, found: frozenset[str]) -> None:
        """Mark the engine (un)metered by the signals just read; log a change."""
        self.engine.metered = bool(found)
        if found == self._reported:
            return
        self._reported = found
        missing = [s for s in SIGNALS if s not in found]
        expected = bool(self.kind.signals - found)  # the dialect should have had them
        if missing:
            log.log(logging.WARNING if expected else logging.INFO,
                    "engine %s (%s): no %s signal(s)%s", self.engine.id, self.kind.name,
                    ", ".join(missing),
                    "" if "kv_usage" in found else "; admitted by the gateway's own "
                    "in-flight accounting and latency observations")
        else:
            log.info("engine %s (%s): all load signals read", self.engine.id, self.kind.name)

    async def read_slots(self) -> int | None:
        """Read the engine's slot count into ``Engine.slots`` unless already read for
        its current generation; returns it (None: no endpoint, or the read failed and
        is retried on the next scrape)."""
        engine, kind = self.engine, self.kind
        if kind.slots_path is None or kind.parse_slots is None:
            return None
        if self._slots_generation == engine.generation:
            return engine.slots
        url = f"{engine.base_url}{kind.slots_path}"
        try:
            async with self.session.get(url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    log.debug("slots %s: HTTP %d", url, resp.status)
                    return None
                slots = kind.parse_slots(await resp.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            log.debug("slots %s: %r", url, e)
            return None
        self._slots_generation = engine.generation
        if slots != engine.slots:
            log.info("engine %s (%s): %s slots", engine.id, kind.name, slots)
            engine.slots = slots
            self.pool.notify()
        return slots

    async def scrape_once(self) -> MetricsSnapshot | None:
        """One scrape (and the slot count, when due); stores and returns the snapshot,
        or None if it failed."""
        await self.read_slots()
        if self.kind.metrics_path is None or self.kind.parse is None:
            self._signals(frozenset())
            return None
        url = f"{self.engine.base_url}{self.kind.metrics_path}"
        in_flight = self.engine.in_flight
        try:
            async with self.session.get(url, timeout=self.timeout) as resp:
                if resp.status == 404:
                    self._signals(frozenset())
                if resp.status != 200:
                    log.debug("metrics %s: HTTP %d", url, resp.status)
                    return None
                text = await resp.text()
            snapshot = self.kind.parse(text, self.clock.now(), self.engine.metrics)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            log.debug("metrics %s: %r", url, e)
            return None
        self._signals(snapshot.signals)
        self.pool.set_metrics(self.engine, snapshot, in_flight)
        return snapshot

    async def run(self) -> None:
        """Scrape until cancelled (returns at once for a dialect without metrics)."""
        if self.kind.metrics_path is None:
            await self.scrape_once()
            return
        while True:
            started = self.clock.now()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock.now() - started)))
