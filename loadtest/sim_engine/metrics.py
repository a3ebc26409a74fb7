"""vLLM's ``/metrics`` exposition, the one writer shared by the simulated engine, the
stand-in and the test fakes.

:class:`VllmExposition` renders, from a private :class:`CollectorRegistry` with
``generate_latest``, the metrics the gateway reads with vLLM 0.32's names, types,
help texts and labels (``model_name``, ``engine``): gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``; counters (``_total`` and ``_created`` samples)
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
``vllm:external_prefix_cache_queries``, ``vllm:external_prefix_cache_hits`` (a KV
connector's lookups and loads), ``vllm:prompt_tokens_cached`` (local + external),
``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``; the info
gauge ``vllm:cache_config_info``; and the ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds`` histograms with vLLM's buckets. Sources: ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger``), ``vllm/v1/metrics/buckets.py``, ``vllm/config/cache.py``
(``CacheConfig.metrics_info``); a real scrape is in
``tests/fixtures/vllm_cpu_0.32_metrics_*.txt``.

Gauges and counters are read at scrape time from an :class:`EngineStats` callback
(no per-step bookkeeping); the histograms are observed by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from loadtest.sim_engine.scheduler import Scheduler

#: ``TIME_TO_FIRST_TOKEN_BUCKETS`` in ``vllm/v1/metrics/buckets.py``, s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: ``INTER_TOKEN_LATENCY_BUCKETS`` in the same file, s.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LABELS = ("model_name", "engine")


@dataclass
class EngineStats:
    """What an engine reports at one instant.

    Attributes:
        running: requests in the running batch.
        waiting: requests queued in the engine.
        kv_cache_usage: used KV-cache blocks, fraction 0–1.
        prefix_cache_queries: prompt tokens looked up in the prefix cache, total.
        prefix_cache_hits: of those, tokens found cached, total.
        external_prefix_cache_queries: prompt tokens a KV connector was asked for
            beyond the local hits, total.
        external_prefix_cache_hits: of those, tokens it loaded from a remote
            (prefill) engine, total; ``vllm:prompt_tokens_cached`` is both hits.
        prompt_tokens: prefill tokens processed, total.
        generation_tokens: tokens generated, total.
        num_preemptions: preemption events, total.
    """

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0


class _StatsCollector(Collector):
    """Scrape-time gauges, counters and the cache-config info gauge."""

    def __init__(self, stats: Callable[[], EngineStats], labels: list[str],
                 cache_info: dict[str, str], created: float) -> None:
        self._stats, self._labels = stats, labels
        self._cache_info, self._created = cache_info, created

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=_LABELS)
        c.add_metric(self._labels, value, created=self._created)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", s.running)
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            s.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            s.prefix_cache_hits)
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries from KV connector cross-instance "
                            "cache sharing, in terms of number of queried tokens.",
                            s.external_prefix_cache_queries)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits from KV connector cross-instance "
                            "cache sharing, in terms of number of cached tokens.",
                            s.external_prefix_cache_hits)
        yield self._counter("vllm:prompt_tokens_cached",
                            "Number of cached prompt tokens (local + external).",
                            s.prefix_cache_hits + s.external_prefix_cache_hits)
        yield self._counter("vllm:num_preemptions",
                            "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s.generation_tokens)
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(self._cache_info))
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info


class VllmExposition:
    """A vLLM engine's ``/metrics`` (see the module doc).

    Args:
        model_name: the ``model_name`` label (the served model name).
        stats: returns the current :class:`EngineStats`; called on every render.
        block_size: KV block size, tokens (``cache_config_info``).
        num_gpu_blocks: KV blocks (``cache_config_info``; ``kv_cache_size_tokens`` is
            ``(num_gpu_blocks − 1) × block_size``, vLLM reserving one null block).
        engine: the ``engine`` label (data-parallel rank).
        clock: wall clock for the counters' ``_created`` samples, s since the epoch.

    Attributes:
        ttft: the TTFT histogram child to ``observe(seconds)``.
        itl: the inter-token-latency histogram child to ``observe(seconds)``.
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], *,
                 block_size: int = 16, num_gpu_blocks: int = 1000, engine: str = "0",
                 clock: Callable[[], float] = time.time) -> None:
        labels = [model_name, engine]
        cache_info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "kv_cache_size_tokens": str((num_gpu_blocks - 1) * block_size),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "sha256",
            "cache_dtype": "auto",
            "engine": engine,
        }
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(stats, labels, cache_info, clock()))
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              _LABELS, registry=self.registry,
                              buckets=TTFT_BUCKETS).labels(*labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             _LABELS, registry=self.registry,
                             buckets=ITL_BUCKETS).labels(*labels)

    def render(self) -> bytes:
        """Prometheus text exposition format 0.0.4."""
        return generate_latest(self.registry)


def sim_metrics(scheduler: Scheduler, model_name: str, engine: str = "0") -> VllmExposition:
    """The simulated engine's exposition: stats read from ``scheduler`` at scrape
    time; latencies observed by the engine loop in wall seconds, as its clients see
    them (a real engine's histograms measure what its clients wait; at ``--speed``
    other than 1 they differ from the profile's device by that factor)."""

    def stats() -> EngineStats:
        c = scheduler.counters
        return EngineStats(running=len(scheduler.running), waiting=len(scheduler.waiting),
                           kv_cache_usage=scheduler.kv.usage,
                           prefix_cache_queries=c.prefix_cache_queries,
                           prefix_cache_hits=c.prefix_cache_hits,
                           external_prefix_cache_queries=c.external_prefix_cache_queries,
                           external_prefix_cache_hits=c.external_prefix_cache_hits,
                           prompt_tokens=c.prompt_tokens,
                           generation_tokens=c.generation_tokens,
                           num_preemptions=c.num_preemptions)

    p = scheduler.profile
    return VllmExposition(model_name, stats, block_size=p.block_size,
                          num_gpu_blocks=p.num_blocks, engine=engine)
