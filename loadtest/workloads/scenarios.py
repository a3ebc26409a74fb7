"""Scenario workloads from practice, with Poisson arrivals at ``rate`` (requests/s)
unless stated, sized by ``limit`` or ``duration_s`` (default 200 requests), seeded
by ``seed``. Prompts are unique filler text (one token per word under the fallback
tokenizer)."""

from __future__ import annotations

import random

from loadtest.workloads.base import (
    RequestSpec,
    Workload,
    WorkloadOptions,
    poisson_times,
    synthetic_text,
)

DEFAULT_COUNT = 200


def _count(opts: WorkloadOptions, rate: float) -> int:
    if opts.limit is not None:
        return opts.limit
    return int(opts.duration_s * rate) + 1 if opts.duration_s else DEFAULT_COUNT


def short(opts: WorkloadOptions) -> Workload:
    """Short chat turns: 10–60 prompt tokens, 16–64 output tokens."""
    rng = random.Random(opts.seed)
    specs = [RequestSpec(t, "default", "standard", opts.chat_body(
        synthetic_text(f"short/{opts.seed}/{i}", rng.randint(10, 60)),
        opts.output_tokens(rng.randint(16, 64))))
        for i, t in enumerate(poisson_times(_count(opts, opts.rate), opts.rate, rng))]
    return Workload("short", opts.bounded(specs), "short requests")


def long_context(opts: WorkloadOptions) -> Workload:
    """Long documents: prompts of 50–100% of ``max_input_tokens`` (default 8,192),
    64 output tokens."""
    rng = random.Random(opts.seed)
    top = opts.max_input_tokens or 8192
    specs = [RequestSpec(t, "default", "standard", opts.chat_body(
        synthetic_text(f"long/{opts.seed}/{i}", rng.randint(top // 2, top)),
        opts.output_tokens(64)))
        for i, t in enumerate(poisson_times(_count(opts, opts.rate), opts.rate, rng))]
    return Workload("long-context", opts.bounded(specs), f"prompts of {top // 2}–{top} tokens")


def high_concurrency(opts: WorkloadOptions) -> Workload:
    """A burst: ``limit`` (default 256) requests spread uniformly over the first
    second, 100–300 prompt tokens, 128 output tokens."""
    rng = random.Random(opts.seed)
    n = opts.limit or 256
    specs = [RequestSpec(rng.random(), "default", "standard", opts.chat_body(
        synthetic_text(f"burst/{opts.seed}/{i}", rng.randint(100, 300)),
        opts.output_tokens(128))) for i in range(n)]
    return Workload("high-concurrency", opts.bounded(specs), f"{n} requests within 1 s")


#: (tenant, priority, api key slot, share of traffic, shared system prompt tokens).
TENANTS = (
    ("acme", "interactive", 0, 0.3, 1024),
    ("globex", "standard", 1, 0.5, 2048),
    ("initech", "batch", 2, 0.2, 512),
)


def mixed_tenants(opts: WorkloadOptions) -> Workload:
    """Three tenants (:data:`TENANTS`) with different priorities and shares; each
    tenant's requests share its system prompt (prefix reuse within a tenant, none
    across), then a unique user turn of 50–400 tokens; 32–256 output tokens."""
    rng = random.Random(opts.seed)
    specs = []
    for i, t in enumerate(poisson_times(_count(opts, opts.rate), opts.rate, rng)):
        name, prio, slot, _, sys_tokens = rng.choices(TENANTS, [x[3] for x in TENANTS])[0]
        messages = [
            {"role": "system", "content": synthetic_text(f"tenant/{name}/system", sys_tokens)},
            {"role": "user", "content": synthetic_text(f"mixed/{opts.seed}/{i}",
                                                       rng.randint(50, 400))},
        ]
        specs.append(RequestSpec(t, name, prio, opts.body(
            messages, opts.output_tokens(rng.randint(32, 256))), api_key_slot=slot))
    return Workload("mixed-tenants", opts.bounded(specs), "three tenants, three priorities")
