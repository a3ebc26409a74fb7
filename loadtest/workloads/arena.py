"""Arena-Hard prompts (lmarena/arena-hard-auto): real user prompts, sent with Poisson
arrivals at ``rate`` requests/s, cycling through the file in a seeded shuffled
order."""

from __future__ import annotations

import json
import random
from pathlib import Path

from loadtest.workloads.base import RequestSpec, Workload, WorkloadOptions, data_dir, poisson_times

#: Requests when neither ``limit`` nor ``duration_s`` bounds the workload.
DEFAULT_COUNT = 500
#: Default output tokens per request (Arena-Hard answers are long; capped here).
DEFAULT_MAX_TOKENS = 256


def prompts_path(version: str) -> Path:
    """``version``: ``v0.1`` (500 prompts) or ``v2.0`` (750)."""
    return data_dir() / "prompts" / f"arena_hard_{version}_question.jsonl"


def read_prompts(version: str = "v0.1", path: Path | None = None) -> list[str]:
    with open(path or prompts_path(version), encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def arena_hard(opts: WorkloadOptions, version: str = "v0.1") -> Workload:
    """Poisson(``rate``) arrivals of Arena-Hard prompts; ``max_tokens`` =
    ``max_output_tokens`` or 256; prompts longer than ``max_input_tokens`` × 3
    characters are skipped (≈ 3.5 characters per token)."""
    rng = random.Random(opts.seed)
    prompts = read_prompts(version)
    if opts.max_input_tokens:
        prompts = [p for p in prompts if len(p) <= opts.max_input_tokens * 3]
    rng.shuffle(prompts)
    n = opts.limit or (int(opts.duration_s * opts.rate) + 1 if opts.duration_s
                       else DEFAULT_COUNT)
    times = poisson_times(n, opts.rate, rng)
    max_tokens = opts.max_output_tokens or DEFAULT_MAX_TOKENS
    specs = [RequestSpec(t, "default", "standard",
                         opts.chat_body(prompts[i % len(prompts)], max_tokens))
             for i, t in enumerate(times)]
    return Workload(f"arena-hard-{version}", opts.bounded(specs),
                    f"Arena-Hard {version} prompts, Poisson {opts.rate}/s")
