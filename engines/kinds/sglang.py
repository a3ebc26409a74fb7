"""SGLang's dialect (``kind: external``, ``dialect: sglang``).

Read from SGLang's ``python/sglang/srt/metrics/collector.py`` (main at commit
``00ae9c1``, SGLang 0.5.x) and ``docs/references/production_metrics.md``; checked
against the simulator speaking this dialect (``python -m loadtest.sim_engine --dialect
sglang``), not a real SGLang server:

* ``GET /metrics`` (Prometheus text, with ``--enable-metrics``):
  ``sglang:num_running_reqs`` → running, ``sglang:num_queue_reqs`` → waiting,
  ``sglang:token_usage`` (fraction 0–1 of the KV token pool) → KV usage,
  ``sglang:max_total_num_tokens`` (KV pool size, tokens) → blocks of 1 token (SGLang's
  RadixAttention pages are a token each with the default ``--page-size 1``),
  ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total`` → prefix queries
  and hits (tokens; the latter labelled ``cache_source`` in newer versions, summed).
* ``GET /health`` 200 once the model is loaded (``/health_generate`` runs a real
  generation); ``GET /v1/models``.
* Accepts ``stream_options.include_usage``; per-request ``priority`` only with
  ``--enable-priority-scheduling``; no ``cache_salt``.
* Errors: OpenAI form; an overloaded server answers 503 (retried elsewhere).
"""

from __future__ import annotations

from engines.kinds import EngineKind, present
from engines.kinds.prom import prometheus_samples
from engines.pool import MetricsSnapshot

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
USAGE = "sglang:token_usage"
POOL_TOKENS = "sglang:max_total_num_tokens"
PROMPT = "sglang:prompt_tokens"
CACHED = "sglang:cached_tokens"
GENERATED = "sglang:generation_tokens"


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """SGLang's ``/metrics`` page → snapshot; several label sets (data-parallel ranks)
    are summed, usage averaged.

    Raises:
        ValueError: the text is not Prometheus exposition.
    """
    v = prometheus_samples(text, (RUNNING, WAITING, USAGE, POOL_TOKENS, PROMPT, CACHED,
                                  GENERATED))

    def total(name: str) -> float:
        return sum(v.get(name, ()))

    usage = v.get(USAGE)
    pool = int(total(POOL_TOKENS)) if POOL_TOKENS in v else None
    return MetricsSnapshot(
        at=at,
        kv_cache_usage=sum(usage) / len(usage) if usage else None,
        num_running=int(total(RUNNING)),
        num_waiting=int(total(WAITING)),
        prefix_cache_queries=total(PROMPT),
        prefix_cache_hits=total(CACHED),
        generation_tokens=total(GENERATED),
        block_size=1 if pool else None,
        num_blocks=pool or None,
        signals=present(kv_usage=bool(usage), running=RUNNING in v, waiting=WAITING in v,
                        prefix_hits=CACHED in v and PROMPT in v, block_size=bool(pool),
                        num_blocks=bool(pool)),
    )


KIND = EngineKind(
    name="sglang", metrics_path="/metrics", parse=parse,
    signals=frozenset({"kv_usage", "running", "waiting", "prefix_hits", "block_size",
                       "num_blocks"}),
    quirks="KV pool counted in tokens (page size 1); cache hit rate also as a gauge",
)
