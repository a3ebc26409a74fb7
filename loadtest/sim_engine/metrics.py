"""``/metrics`` of the simulated engine, with vLLM's metric names, label names and
histogram buckets (``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``,
``vllm/v1/metrics/buckets.py``), in a private :class:`CollectorRegistry`.

Gauges and counters are read from the scheduler at scrape time (no per-step
bookkeeping); the TTFT and inter-token histograms are observed by the engine loop.
Latencies are in simulated seconds (wall seconds × ``--speed``), so they compare
with the device the profile describes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtest.sim_engine.scheduler import Scheduler

#: ``TIME_TO_FIRST_TOKEN_BUCKETS`` in ``vllm/v1/metrics/buckets.py``, s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: ``INTER_TOKEN_LATENCY_BUCKETS`` in the same file, s.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LABELS = ("model_name", "engine")


class _SchedulerCollector(Collector):
    """Scrape-time gauges and counters from a :class:`Scheduler`."""

    def __init__(self, scheduler: Scheduler, model_name: str, engine: str) -> None:
        self._s = scheduler
        self._values = [model_name, engine]
        p = scheduler.profile
        # vllm:cache_config_info: labels are CacheConfig.metrics_info() plus
        # "engine" (vllm/config/cache.py); the sim exports the fields it models.
        self._cache_info = {
            "block_size": str(p.block_size),
            "num_gpu_blocks": str(p.num_blocks),
            "kv_cache_size_tokens": str((p.num_blocks - 1) * p.block_size),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "blake2b-64",
            "cache_dtype": "auto",
            "engine": engine,
        }

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=_LABELS)
        c.add_metric(self._values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        s, c = self._s, self._s.counters
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", len(s.running))
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", len(s.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", s.kv.usage)
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            c.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            c.prefix_cache_hits)
        yield self._counter("vllm:prompt_tokens_cached",
                            "Number of cached prompt tokens (local + external).",
                            c.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption "
                            "from the engine.", c.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            c.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens "
                            "processed.", c.generation_tokens)
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(self._cache_info))
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info


class SimMetrics:
    """The engine's registry: scheduler-backed gauges/counters plus TTFT and
    inter-token-latency histograms (labels ``model_name``, ``engine``), and one
    series vLLM does not have, ``sim:requests_by_priority_total{priority}``
    (requests received per ``priority`` value, so tests can see what was sent)."""

    def __init__(self, scheduler: Scheduler, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(scheduler, model_name, engine))
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              _LABELS, registry=self.registry,
                              buckets=TTFT_BUCKETS).labels(model_name, engine)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             _LABELS, registry=self.registry,
                             buckets=ITL_BUCKETS).labels(model_name, engine)
        self.priority = Counter("sim:requests_by_priority", "Requests received by priority.",
                                ["priority"], registry=self.registry)

    def render(self) -> bytes:
        """Prometheus text exposition format 0.0.4."""
        return generate_latest(self.registry)
