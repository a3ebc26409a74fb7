"""The Mooncake conversation trace (kvcache-ai/Mooncake, FAST'25 release): arrival
times, token counts and ``hash_ids`` (ids of the prompt's 512-token blocks; equal ids
mean an identical prefix up to that block).

Replay text: block id ``h`` always becomes the same 512-token filler
(:func:`~loadtest.workloads.base.text_block` keyed ``mooncake/h``), so two prompts
sharing leading ids share their leading text, and the replay's prefix reuse
matches the trace's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loadtest.workloads.base import (
    BLOCK_TOKENS,
    RequestSpec,
    Workload,
    WorkloadOptions,
    data_dir,
    text_block,
)


def trace_path() -> Path:
    return data_dir() / "mooncake" / "conversation_trace.jsonl"


def read_trace(path: Path | None = None) -> list[dict[str, Any]]:
    """The trace's records (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``), in file order."""
    with open(path or trace_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_text(hash_ids: list[int], input_length: int) -> str:
    """Filler text of ``input_length`` tokens whose 512-token blocks follow
    ``hash_ids`` (the last block cut to the remainder)."""
    parts, left = [], input_length
    for h in hash_ids:
        if left <= 0:
            break
        n = min(left, BLOCK_TOKENS)
        parts.append(text_block(f"mooncake/{h}", n))
        left -= n
    return "".join(parts)


def mooncake(opts: WorkloadOptions, path: Path | None = None) -> Workload:
    """Requests at ``timestamp / 1000 × time_scale`` s, prompt as one user message
    of ``input_length`` tokens (capped by ``max_input_tokens``), ``max_tokens`` =
    ``output_length`` (capped by ``max_output_tokens``). Text is built only for
    requests inside the ``limit``/``duration_s`` bounds."""
    records = read_trace(path)
    specs = []
    for r in records:
        at = r["timestamp"] / 1000.0 * opts.time_scale
        if opts.duration_s is not None and at >= opts.duration_s:
            continue
        specs.append((at, r))
    specs.sort(key=lambda x: x[0])
    if opts.limit is not None:
        specs = specs[: opts.limit]
    out = [RequestSpec(at, "default", "standard", opts.chat_body(
        prompt_text(r["hash_ids"], opts.input_tokens(r["input_length"])),
        opts.output_tokens(r["output_length"]))) for at, r in specs]
    return Workload("mooncake-conversation", out,
                    f"Mooncake conversation trace ({path or trace_path()})")


def ideal_hits(records: Iterable[dict[str, Any]], block_tokens: int = BLOCK_TOKENS,
               ) -> list[int]:
    """Prompt tokens each record finds in an unlimited prefix cache: the leading run of
    its blocks already seen in earlier records, in tokens (at most its
    ``input_length``), in the records' order."""
    seen: set[int] = set()
    hits = []
    for r in records:
        ids = r["hash_ids"]
        matched = 0
        for h in ids:
            if h not in seen:
                break
            matched += 1
        hits.append(min(matched * block_tokens, r["input_length"]))
        seen.update(ids)
    return hits


def ideal_hit_rate(records: Iterable[dict[str, Any]], block_tokens: int = BLOCK_TOKENS,
                   ) -> float:
    """Token prefix-cache hit rate with an unlimited cache (:func:`ideal_hits` over all
    input tokens). 0.374 for the full trace (shared/data/MANIFEST.md)."""
    records = list(records)
    total = sum(r["input_length"] for r in records)
    return sum(ideal_hits(records, block_tokens)) / total if total else 0.0
