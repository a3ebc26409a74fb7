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

from engines.kinds import SIGNALS, EngineKind, present
from engines.pool import Engine, EnginePool, MetricsSnapshot
from limits.clock import MONOTONIC
from limits.engine_latency import EngineCounters
from limits.interfaces import Clock

log = logging.getLogger(__name__)

KV_USAGE = "vllm:kv_cache_usage_perc"
#: Name of the KV usage gauge in older vLLM versions (same meaning, 0–1).
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
#: Prompt tokens a KV connector loaded from another engine (a disaggregated decode
#: leg's prefill), counted at admission like the local hits (vLLM 0.32,
#: ``vllm/v1/metrics/loggers.py``, ``connector_prefix_cache_stats``).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
CACHE_CONFIG = "vllm:cache_config_info"
GENERATION = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
#: Histograms whose ``_sum``/``_count`` feed the adaptive admission's model.
ITL = "vllm:inter_token_latency_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"


@dataclass
class _Series:
    """Values of one metric name, one per label set, in exposition order."""

    values: list[float] = field(default_factory=list)
    labels: list[dict[str, str]] = field(default_factory=list)


#: Sample lines worth parsing start with one of these; vLLM's full exposition is
#: ~55 kB of mostly histograms, which prometheus_client parses in tens of ms.
_WANTED = (KV_USAGE, KV_USAGE_OLD, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS, EXTERNAL_HITS,
           CACHE_CONFIG,
           GENERATION, PROMPT_TOKENS + "_total", PROMPT_TOKENS + " ", PROMPT_TOKENS + "{",
           *(h + s for h in (ITL, PREFILL_TIME, COMPUTED_TOKENS) for s in ("_sum", "_count")))


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
    comes from the first label set. The KV capacity is the engine's own figure where
    it exports one, ``kv_cache_size_tokens`` (summed; vLLM 0.32
    ``vllm/v1/core/kv_cache_utils.py`` ``update_kv_cache_capacity``, the figure of
    its ``"KV cache size: N tokens"`` log line: ``get_max_concurrency_for_kv_cache_config``
    × ``max_model_len``, the pool's blocks divided among the model's KV-cache
    groups, so a hybrid model
    whose sliding-window and full-attention layers share one pool, as Gemma 3's six
    groups do, holds ``num_gpu_blocks × block_size / groups`` tokens, 55,356 and not
    349,440 for the packaged engine); ``num_blocks`` is then that capacity in blocks,
    ``kv_cache_size_tokens // block_size`` (what one sequence's blocks are counted
    against: the KV budget, the prefix index, the capacity report). Without the
    label, ``num_gpu_blocks`` as exported. ``vllm:kv_cache_usage_perc`` wins over the older
    ``vllm:gpu_cache_usage_perc`` when both appear; counters are accepted with or
    without the ``_total`` suffix. Absent metrics keep the snapshot's defaults.
    ``counters`` holds the sums and counts of the inter-token latency, prefill time
    and computed-tokens histograms and the prompt-token counter when the ITL or
    prefill-time histogram is there (None otherwise).

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

    def maybe(name: str) -> float | None:
        return total(name) if name in series else None

    usage = series.get(KV_USAGE) or series.get(KV_USAGE_OLD)
    running, waiting = int(total(RUNNING)), int(total(WAITING))
    counters = None
    if f"{ITL}_count" in series or f"{PREFILL_TIME}_count" in series:
        counters = EngineCounters(
            at=at, load=running + waiting, running=running,
            itl_sum_s=maybe(f"{ITL}_sum"), itl_count=maybe(f"{ITL}_count"),
            prefill_sum_s=maybe(f"{PREFILL_TIME}_sum"),
            prefill_count=maybe(f"{PREFILL_TIME}_count"),
            computed_tokens=maybe(f"{COMPUTED_TOKENS}_sum"),
            prompt_tokens=maybe(PROMPT_TOKENS), cached_tokens=total(PREFIX_HITS),
            external_tokens=total(EXTERNAL_HITS), queried_tokens=maybe(PREFIX_QUERIES),
            generated_tokens=maybe(GENERATION))
    block_size = num_blocks = kv_tokens = None
    info = series.get(CACHE_CONFIG)
    if info:
        block_size = _int_label(info.labels[0], "block_size")

        def summed(key: str) -> int | None:
            known = [v for v in (_int_label(labels, key) for labels in info.labels)
                     if v is not None]
            return sum(known) if known else None

        num_blocks = summed("num_gpu_blocks")
        kv_tokens = summed("kv_cache_size_tokens")
        if kv_tokens is not None and block_size:
            num_blocks = kv_tokens // block_size
    return MetricsSnapshot(
        at=at,
        kv_cache_usage=sum(usage.values) / len(usage.values) if usage else None,
        num_running=running,
        num_waiting=waiting,
        prefix_cache_queries=total(PREFIX_QUERIES),
        prefix_cache_hits=total(PREFIX_HITS),
        generation_tokens=total(GENERATION),
        block_size=block_size,
        num_blocks=num_blocks,
        kv_tokens=kv_tokens,
        signals=present(kv_usage=usage is not None, running=RUNNING in series,
                        waiting=WAITING in series,
                        prefix_hits=PREFIX_HITS in series and PREFIX_QUERIES in series,
                        block_size=block_size is not None, num_blocks=num_blocks is not None),
        counters=counters,
    )


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
        from engines.kinds import KINDS

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
        """Read the engine's slot count into ``Engine.slots`` (and one slot's context
        into ``Engine.slot_tokens`` where the dialect has it) unless already read for
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
                props = await resp.json(content_type=None)
                slots = kind.parse_slots(props)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            log.debug("slots %s: %r", url, e)
            return None
        self._slots_generation = engine.generation
        if kind.parse_slot_tokens is not None:
            engine.slot_tokens = kind.parse_slot_tokens(props)
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
