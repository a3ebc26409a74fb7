"""Read an engine's Prometheus ``/metrics`` into a :class:`MetricsSnapshot`.

:func:`parse_metrics` is pure; :class:`MetricsPoller` is the per-engine I/O loop that
scrapes on an interval and stores each snapshot with :meth:`EnginePool.set_metrics`.
Metric names are vLLM's (see ``docs/engines.md``, "Metrics").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engines.pool import Engine, EnginePool, MetricsSnapshot
from limits.clock import MONOTONIC
from limits.interfaces import Clock

log = logging.getLogger(__name__)

KV_USAGE = "vllm:kv_cache_usage_perc"
#: Name of the KV usage gauge in older vLLM versions (same meaning, 0–1).
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
CACHE_CONFIG = "vllm:cache_config_info"
GENERATION = "vllm:generation_tokens"


@dataclass
class _Series:
    """Values of one metric name, one per label set, in exposition order."""

    values: list[float] = field(default_factory=list)
    labels: list[dict[str, str]] = field(default_factory=list)


#: Sample lines worth parsing start with one of these; vLLM's full exposition is
#: ~55 kB of mostly histograms, which prometheus_client parses in tens of ms.
_WANTED = (KV_USAGE, KV_USAGE_OLD, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS, CACHE_CONFIG,
           GENERATION)


def _collect(text: str) -> dict[str, _Series]:
    """Samples by name, with a counter's ``_total`` suffix removed and ``_created``
    samples dropped, so old and new counter spellings land under one key.

    Only sample lines of the metrics in ``_WANTED`` reach the parser (comments and
    other metrics are skipped first), which keeps a scrape to well under a
    millisecond of event-loop time.
    """
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    out: dict[str, _Series] = {}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created"):
                continue
            name = name.removesuffix("_total")
            series = out.setdefault(name, _Series())
            series.values.append(float(sample.value))
            series.labels.append(dict(sample.labels))
    return out


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):
        return None


def parse_metrics(text: str, at: float) -> MetricsSnapshot:
    """Parse vLLM's Prometheus text exposition into a snapshot taken at ``at``.

    Several label sets of one metric (vLLM labels each data-parallel rank with
    ``engine="N"``) are combined: request counts, prefix-cache counters and
    ``num_gpu_blocks`` are summed; KV usage, a fraction, is their mean; ``block_size``
    comes from the first label set. ``vllm:kv_cache_usage_perc`` wins over the older
    ``vllm:gpu_cache_usage_perc`` when both appear; counters are accepted with or
    without the ``_total`` suffix. Absent metrics keep the snapshot's defaults.

    Args:
        text: the body of ``GET /metrics`` (Prometheus text format 0.0.4).
        at: clock time of the scrape, s.

    Raises:
        ValueError: the text is not valid Prometheus exposition.
    """
    series = _collect(text)

    def total(name: str) -> float:
        s = series.get(name)
        return sum(s.values) if s else 0.0

    usage = series.get(KV_USAGE) or series.get(KV_USAGE_OLD)
    block_size = num_blocks = None
    info = series.get(CACHE_CONFIG)
    if info:
        block_size = _int_label(info.labels[0], "block_size")
        known = [
            b for b in (_int_label(labels, "num_gpu_blocks") for labels in info.labels)
            if b is not None
        ]
        num_blocks = sum(known) if known else None
    return MetricsSnapshot(
        at=at,
        kv_cache_usage=sum(usage.values) / len(usage.values) if usage else None,
        num_running=int(total(RUNNING)),
        num_waiting=int(total(WAITING)),
        prefix_cache_queries=total(PREFIX_QUERIES),
        prefix_cache_hits=total(PREFIX_HITS),
        generation_tokens=total(GENERATION),
        block_size=block_size,
        num_blocks=num_blocks,
    )


class MetricsPoller:
    """Scrapes one engine's ``/metrics`` every ``interval_s`` and stores the snapshot
    in the pool.

    A failed scrape (connection refused, timeout, non-200, unparsable text) keeps the
    previous snapshot; consumers judge freshness by ``snapshot.at`` against
    ``SupervisorConfig.metrics_stale_s``. The engine's ``base_url`` is read on every
    scrape, so it may change across restarts.

    Args:
        pool: where snapshots are stored (:meth:`EnginePool.set_metrics`).
        engine: the engine to scrape.
        session: the shared client session (not closed here).
        interval_s: time between the starts of two scrapes, s
            (``SupervisorConfig.metrics_interval_s``).
        timeout_s: limit of one scrape, s (``SupervisorConfig.probe_timeout_s``).
        clock: monotonic clock giving ``snapshot.at``, s.
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
    ) -> None:
        self.pool = pool
        self.engine = engine
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.clock = clock

    async def scrape_once(self) -> MetricsSnapshot | None:
        """One scrape; stores and returns the snapshot, or None if it failed."""
        url = f"{self.engine.base_url}/metrics"
        try:
            async with self.session.get(url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    log.debug("metrics %s: HTTP %d", url, resp.status)
                    return None
                text = await resp.text()
            snapshot = parse_metrics(text, self.clock.now())
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            log.debug("metrics %s: %r", url, e)
            return None
        self.pool.set_metrics(self.engine, snapshot)
        return snapshot

    async def run(self) -> None:
        """Scrape until cancelled."""
        while True:
            started = self.clock.now()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock.now() - started)))
