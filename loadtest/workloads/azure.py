"""Azure LLM inference traces 2023 (Azure/AzurePublicDataset): one hour of a
production code-completion service and of a chat service; per request an arrival
``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens``. No text and no prefix
structure: each prompt is unique filler of the given length."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from loadtest.workloads.base import RequestSpec, Workload, WorkloadOptions, data_dir, synthetic_text


def trace_path(kind: str) -> Path:
    """``kind``: ``code`` or ``conv``."""
    return data_dir() / "azure" / f"AzureLLMInferenceTrace_{kind}_2023.csv"


def _ts(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than fromisoformat's 6.
    head, _, frac = text.partition(".")
    return datetime.fromisoformat(head).timestamp() + float("0." + (frac or "0"))


def azure(kind: str, opts: WorkloadOptions, path: Path | None = None) -> Workload:
    """Requests at trace time × ``time_scale`` from the first row; prompt = unique
    filler of ``ContextTokens`` (capped by ``max_input_tokens``), ``max_tokens`` =
    ``GeneratedTokens`` (capped)."""
    with open(path or trace_path(kind), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    t0 = _ts(rows[0]["TIMESTAMP"]) if rows else 0.0
    timed = sorted(((_ts(r["TIMESTAMP"]) - t0) * opts.time_scale, i, r)
                   for i, r in enumerate(rows))
    if opts.duration_s is not None:
        timed = [t for t in timed if t[0] < opts.duration_s]
    if opts.limit is not None:
        timed = timed[: opts.limit]
    specs = [RequestSpec(at, "default", "standard", opts.chat_body(
        synthetic_text(f"azure-{kind}/{opts.seed}/{i}",
                       opts.input_tokens(int(r["ContextTokens"]))),
        opts.output_tokens(int(r["GeneratedTokens"])))) for at, i, r in timed]
    return Workload(f"azure-{kind}", specs, f"Azure LLM inference trace 2023, {kind}")
