"""The simulated engine's dialects: the paths, metric names and formats, and API quirks
of each serving engine Sluice reads (``--dialect``), over one simulated engine core.

Each page is written from the same scheduler state (running and waiting requests, KV
blocks in use, prefix-cache counters), so a test can check that every dialect's parser
in :mod:`engines.kinds` maps the engine's own names back onto the same load. Sources
(the same files the parsers cite):

* ``vllm``: ``/metrics`` of :class:`loadtest.sim_engine.metrics.SimMetrics` (vLLM 0.32
  names).
* ``llamacpp``: llama.cpp's hand-written exposition (``server-task.cpp``
  ``to_metrics``, the tree vendored in llama-cpp-python 0.3.36): ``# HELP`` / ``# TYPE``
  / one unlabelled sample per metric, counters already ending in ``_total``; and
  ``GET /props`` with ``total_slots`` (``get_res_props`` in ``server-context.cpp``), the
  simulator's ``--max-num-seqs``.
* ``sglang``: ``sglang/srt/metrics/collector.py`` (commit ``00ae9c1``): gauges
  labelled ``model_name``; ``cached_tokens_total`` also labelled ``cache_source``.
* ``tgi``: ``router/src/server.rs`` (commit ``d957e32``): unlabelled ``tgi_*`` gauges
  of the metrics-rs Prometheus exporter; errors ``{"error": str, "error_type": str}``.
* ``trtllm``: ``trtllm-serve``'s ``/metrics``, a JSON list of iteration stats since the
  previous read (``docs/source/commands/trtllm-serve.rst``, commit ``000d771``); the
  simulator writes one entry per read when the engine worked since the last one.
* ``openai``: a bare OpenAI-compatible server: chat completions and ``/v1/models``
  only, no ``/metrics``, ``/health`` or ``/v1/completions`` (the two failures an
  external engine once met).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtest.sim_engine.engine import SimEngine

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Dialect:
    """How one engine kind shows itself over HTTP.

    Attributes:
        name: ``--dialect`` value.
        metrics_path: load-metrics path, None for none.
        render: the metrics page of an engine → (body, content type).
        health: serves ``GET /health``.
        completions: serves ``POST /v1/completions`` (else chat only).
        owned_by: ``owned_by`` of the ``/v1/models`` entry.
        error_body: an error (message, type, HTTP status) → response JSON.
        props: the engine → the JSON of ``GET /props`` (llama.cpp), or None for no
            such route.
    """

    name: str
    metrics_path: str | None
    render: Callable[[SimEngine], tuple[bytes, str]] | None
    health: bool = True
    completions: bool = True
    owned_by: str = "vllm"
    error_body: Callable[[str, str, int], dict[str, Any]] | None = None
    props: Callable[[SimEngine], dict[str, Any]] | None = None


def _vllm(engine: SimEngine) -> tuple[bytes, str]:
    return engine.metrics.render(), PROMETHEUS


def _llamacpp(engine: SimEngine) -> tuple[bytes, str]:
    s, c = engine.scheduler, engine.scheduler.counters
    items = (
        ("prompt_tokens_total", "counter",
         "Number of prompt tokens processed, excluding cached tokens",
         c.prefix_cache_queries - c.prefix_cache_hits),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens served from cache",
         c.prefix_cache_hits),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed",
         c.generation_tokens),
        ("requests_processing", "gauge", "Number of requests processing", len(s.running)),
        ("requests_deferred", "gauge", "Number of requests deferred", len(s.waiting)),
    )
    text = "".join(f"# HELP llamacpp:{n} {doc}\n# TYPE llamacpp:{n} {kind}\nllamacpp:{n} {v}\n"
                   for n, kind, doc, v in items)
    return text.encode(), PROMETHEUS


class _SGLangCollector(Collector):
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> list[Metric]:
        e, s, c = self.engine, self.engine.scheduler, self.engine.scheduler.counters
        labels, values = ["model_name"], [e.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        cached = CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens "
                                     "by source (device/host/storage).",
                                     labels=[*labels, "cache_source"])
        cached.add_metric([*values, "device"], c.prefix_cache_hits)
        hit_rate = c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0
        return [
            gauge("sglang:num_running_reqs", "The number of running requests.", len(s.running)),
            gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                  len(s.waiting)),
            gauge("sglang:token_usage", "The token usage.", e.kv.usage),
            gauge("sglang:max_total_num_tokens",
                  "Maximum total number of tokens in the KV cache pool.",
                  (e.profile.num_blocks - 1) * e.profile.block_size),
            gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate),
            counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                    c.prefix_cache_queries),
            counter("sglang:generation_tokens", "Number of generation tokens processed.",
                    c.generation_tokens),
            cached,
        ]


def _sglang(engine: SimEngine) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SGLangCollector(engine))
    return generate_latest(registry), PROMETHEUS


def _tgi(engine: SimEngine) -> tuple[bytes, str]:
    s = engine.scheduler
    in_batch = sum(r.num_tokens for r in s.running)
    items = (("tgi_queue_size", len(s.waiting)), ("tgi_batch_current_size", len(s.running)),
             ("tgi_batch_current_max_tokens", in_batch))
    text = "".join(f"# TYPE {n} gauge\n{n} {v}\n" for n, v in items)
    return text.encode(), "text/plain; charset=utf-8"


def _tgi_error(message: str, err_type: str, status: int) -> dict[str, Any]:
    return {"error": message, "error_type": "validation" if status < 500 else err_type}


class _TrtllmStats:
    """Iteration stats since the previous read, as trtllm-serve drains its queue."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}
        self._iter: dict[int, int] = {}

    def __call__(self, engine: SimEngine) -> tuple[bytes, str]:
        s, c, kv, p = engine.scheduler, engine.scheduler.counters, engine.kv, engine.profile
        key = id(engine)
        mark = (c.generation_tokens, c.prefix_cache_queries)
        if mark == self._seen.get(key) and not s.has_work:
            return b"[]", "application/json"
        self._seen[key] = mark
        self._iter[key] = self._iter.get(key, 0) + 1
        usable = p.num_blocks - 1  # vLLM's null block is never handed out
        used = usable - kv.num_free_blocks
        hits = c.prefix_cache_hits // p.block_size
        entry = {
            "iter": self._iter[key], "iterLatencyMS": 0.0, "gpuMemUsage": 0,
            "numActiveRequests": len(s.running), "numQueuedRequests": len(s.waiting),
            "maxNumActiveRequests": p.max_num_seqs,
            "kvCacheStats": {
                "maxNumBlocks": usable, "freeNumBlocks": kv.num_free_blocks,
                "usedNumBlocks": used, "tokensPerBlock": p.block_size,
                "allocTotalBlocks": used, "reusedBlocks": hits,
                "missedBlocks": c.prefix_cache_queries // p.block_size - hits,
                "cacheHitRate": (c.prefix_cache_hits / c.prefix_cache_queries
                                 if c.prefix_cache_queries else 0.0),
            },
            "inflightBatchingStats": {"numContextRequests": 0, "numGenRequests": len(s.running),
                                      "numPausedRequests": 0},
        }
        return json.dumps([entry]).encode(), "application/json"


DIALECTS: dict[str, Dialect] = {d.name: d for d in (
    Dialect("vllm", "/metrics", _vllm),
    Dialect("llamacpp", "/metrics", _llamacpp, owned_by="llamacpp",
            props=lambda e: {"total_slots": e.profile.max_num_seqs,
                             "model_alias": e.model_name}),
    Dialect("sglang", "/metrics", _sglang, owned_by="sglang"),
    Dialect("tgi", "/metrics", _tgi, owned_by="text-generation-inference",
            error_body=_tgi_error),
    Dialect("trtllm", "/metrics", _TrtllmStats(), owned_by="tensorrt_llm"),
    Dialect("openai", None, None, health=False, completions=False, owned_by="system"),
)}
