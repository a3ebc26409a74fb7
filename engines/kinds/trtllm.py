"""TensorRT-LLM's ``trtllm-serve`` dialect (``kind: external``, ``dialect: trtllm``).

Read from TensorRT-LLM's ``docs/source/commands/trtllm-serve.rst`` (NVIDIA/TensorRT-LLM
at commit ``000d771``, 0.2x/1.x) and the iteration-stats fields of
``tensorrt_llm/executor`` (``IterationStats``, ``KvCacheStats``); checked against the
simulator speaking this dialect (``--dialect trtllm``), not a real server:

* ``GET /metrics`` is **JSON, not Prometheus**: a list of per-iteration stats since the
  previous request (empty when no iteration ran), each with ``numActiveRequests`` →
  running, ``numQueuedRequests`` → waiting and ``kvCacheStats`` {``maxNumBlocks`` →
  blocks, ``usedNumBlocks`` → usage = used / max, ``tokensPerBlock`` → block size,
  ``reusedBlocks`` and ``missedBlocks`` → prefix hits and queries in tokens (× block
  size)}. The newest entry is used; an empty list means idle (running and waiting 0,
  the KV fields of the previous snapshot kept). Needs ``enable_iter_perf_stats``.
* ``GET /health`` 200; ``GET /v1/models``; ``/v1/completions``, ``/v1/chat/completions``.
* Accepts ``stream_options.include_usage``; no ``cache_salt``.
* Errors: OpenAI form ``{"object": "error", "message", "type", "code"}`` at top level.
"""

from __future__ import annotations

import json
from typing import Any

from engines.kinds import EngineKind, present
from engines.pool import MetricsSnapshot


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """trtllm-serve's ``/metrics`` JSON → snapshot (fields above).

    Raises:
        ValueError: the body is not a JSON list of objects.
    """
    stats = json.loads(text)
    if not isinstance(stats, list) or not all(isinstance(s, dict) for s in stats):
        raise ValueError("trtllm /metrics: expected a JSON list of iteration stats")
    if not stats:
        keep = previous or MetricsSnapshot(at=at)
        return MetricsSnapshot(
            at=at, kv_cache_usage=keep.kv_cache_usage,
            prefix_cache_queries=keep.prefix_cache_queries,
            prefix_cache_hits=keep.prefix_cache_hits,
            generation_tokens=keep.generation_tokens, block_size=keep.block_size,
            num_blocks=keep.num_blocks, signals=keep.signals | {"running", "waiting"})
    last: dict[str, Any] = stats[-1]
    kv = last.get("kvCacheStats") or {}
    max_blocks, used = kv.get("maxNumBlocks"), kv.get("usedNumBlocks")
    block = kv.get("tokensPerBlock")
    usage = used / max_blocks if max_blocks and used is not None else None
    reused, missed = kv.get("reusedBlocks"), kv.get("missedBlocks")
    prefix = reused is not None and missed is not None and bool(block)
    return MetricsSnapshot(
        at=at,
        kv_cache_usage=usage,
        num_running=int(last.get("numActiveRequests", 0)),
        num_waiting=int(last.get("numQueuedRequests", 0)),
        prefix_cache_queries=float((reused + missed) * block) if prefix else 0.0,
        prefix_cache_hits=float(reused * block) if prefix else 0.0,
        block_size=int(block) if block else None,
        num_blocks=int(max_blocks) if max_blocks else None,
        signals=present(kv_usage=usage is not None, running="numActiveRequests" in last,
                        waiting="numQueuedRequests" in last, prefix_hits=prefix,
                        block_size=bool(block), num_blocks=bool(max_blocks)),
    )


KIND = EngineKind(
    name="trtllm", metrics_path="/metrics", parse=parse,
    signals=frozenset({"kv_usage", "running", "waiting", "prefix_hits", "block_size",
                       "num_blocks"}),
    quirks="/metrics is JSON iteration stats, drained per read; errors at top level",
)
