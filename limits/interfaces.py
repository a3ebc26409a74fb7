"""The narrow interfaces ``limits`` depends on.

* :class:`CounterStore` — where rate-limit and concurrency state lives
  (``memory://`` in-process or ``redis://`` shared by every gateway replica).
* :class:`Clock` — monotonic time, injected so tests control it.
* :class:`EngineLoad` — what the saturation check needs to know about one engine;
  the gateway adapts ``engines.pool.Engine`` to it (``limits`` never imports
  ``engines``).
* :class:`EngineCounters` — an engine's scraped latency histograms and token counters,
  as the engines' metric parsers record them and the latency ledger reads them.
* :class:`ReadyEngine` — one ready engine as the SLO gate (:mod:`limits.slo_gate`)
  needs it: its id and reported load.
* :class:`SloView` — what the scheduler's scorers read of the SLO gate (queued
  prefill, TTFT̂ per engine id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Bucket:
    """One GCRA bucket operation.

    Attributes:
        key: store key; keys of one call should share a Redis Cluster hash tag
            (``{tenant}``) so a multi-bucket take stays on one shard.
        cost: units to take (requests or tokens); negative in :meth:`CounterStore.adjust`
            means a refund.
        rate_per_s: sustained rate, units per second (limit per minute / 60).
        burst: bucket capacity, units (one minute's limit for per-minute limits).
    """

    key: str
    cost: float
    rate_per_s: float
    burst: float


@dataclass(frozen=True)
class TakeResult:
    """Answer of :meth:`CounterStore.take`.

    Attributes:
        allowed: every bucket had room; all were charged.
        retry_after_s: when denied, seconds until all buckets would have room; 0 otherwise.
        denied: when denied, index of the bucket that needs the longest wait; else None.
    """

    allowed: bool
    retry_after_s: float = 0.0
    denied: int | None = None


class StoreUnavailable(Exception):
    """The backing service of a :class:`CounterStore` cannot be reached in time."""


class CounterStore(Protocol):
    """Atomic counters for rate limits and concurrency leases.

    Time is the store's own (Redis server time for Redis, an injected clock for
    memory), so every replica sharing a store agrees on it. A store backed by a
    service raises :class:`StoreUnavailable` when it cannot reach it; the store
    ``open_store`` returns handles outages itself (fail open or closed).
    """

    #: Times the store's backing service went from reachable to unreachable (0 for a
    #: store without one); exported as ``sluice_limits_store_failovers``.
    failovers: int
    #: Concurrency-slot releases waiting for the backing service to return (0 for a
    #: store without one); exported as ``sluice_limits_pending_releases``.
    pending_releases: int

    async def take(self, buckets: Sequence[Bucket]) -> TakeResult:
        """All-or-nothing GCRA take: charge every bucket its ``cost`` only if each
        has room now; otherwise charge none."""

    async def adjust(self, bucket: Bucket) -> None:
        """Charge ``bucket.cost`` more (positive: may go into debt) or refund it
        (negative: never above a full bucket), unconditionally."""

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        """Take one of ``limit`` concurrency slots under ``key`` as a lease expiring
        after ``ttl_s`` seconds. Re-acquiring a held ``lease_id`` renews it and
        succeeds even when the slots are full. Expired leases free their slots."""

    async def release(self, key: str, lease_id: str) -> None:
        """Return a lease; releasing an unknown or expired lease does nothing."""

    async def close(self) -> None:
        """Release connections and background tasks."""


class Clock(Protocol):
    """Monotonic time source."""

    def now(self) -> float:
        """Seconds since an arbitrary origin; never goes backwards."""


class EngineLoad(Protocol):
    """One engine's load, as the saturation check needs it.

    Attributes:
        kv_cache_usage: fraction of KV-cache blocks in use, 0–1; None when not reported.
        num_waiting: requests queued inside the engine.
        block_size: tokens per KV block; None when unknown.
        num_blocks: KV blocks in the engine's cache; None when unknown.
        promised_blocks: KV blocks already promised to in-flight requests.
        in_flight: requests this gateway process has sent to the engine and not finished.
        metrics_at: clock time of the metrics scrape, s; None before the first one.
        metered: the engine has a load-metrics endpoint that answers; False for one
            without (then freshness is not required: the gateway's own accounting
            decides).
        slots: the most requests the engine runs at once (a fixed slot count, e.g.
            llama.cpp's ``--parallel``); None when unknown.
        unreported: this gateway's requests on the engine that its last report
            counted neither running nor waiting (held in its front end, where no
            engine metric counts them); 0 when it reports no running count.
    """

    @property
    def kv_cache_usage(self) -> float | None: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def block_size(self) -> int | None: ...

    @property
    def num_blocks(self) -> int | None: ...

    @property
    def promised_blocks(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def metrics_at(self) -> float | None: ...

    @property
    def metered(self) -> bool: ...

    @property
    def unreported(self) -> int: ...

    @property
    def slots(self) -> int | None: ...


@dataclass(frozen=True)
class EngineCounters:
    """An engine's cumulative latency histograms and token counters at one scrape
    (vLLM's names; ``None`` where the engine does not export one).

    Attributes:
        at: clock time of the scrape, s.
        load: requests running + waiting there.
        running: requests running there.
        itl_sum_s / itl_count: ``vllm:inter_token_latency_seconds`` sum (s) and
            count (tokens after each request's first).
        prefill_sum_s / prefill_count: ``vllm:request_prefill_time_seconds`` (first
            scheduled to first token, observed when a request finishes).
        computed_tokens: ``vllm:request_prefill_kv_computed_tokens`` sum (prompt
            tokens the finished requests computed, cache hits excluded).
        prompt_tokens: ``vllm:prompt_tokens`` (prefill tokens, cached included).
        cached_tokens: ``vllm:prefix_cache_hits`` (prompt tokens found cached).
        external_tokens: ``vllm:external_prefix_cache_hits`` (prompt tokens a KV
            connector loaded from another engine: a disaggregated decode leg's
            prompt, computed on its prefill engine).
        queried_tokens: ``vllm:prefix_cache_queries`` (prompt tokens looked up in the
            prefix cache, counted with the hits).
        generated_tokens: ``vllm:generation_tokens``.
    """

    at: float
    load: float
    running: float
    itl_sum_s: float | None = None
    itl_count: float | None = None
    prefill_sum_s: float | None = None
    prefill_count: float | None = None
    computed_tokens: float | None = None
    prompt_tokens: float | None = None
    cached_tokens: float = 0.0
    external_tokens: float = 0.0
    queried_tokens: float | None = None
    generated_tokens: float | None = None


@dataclass(frozen=True)
class ReadyEngine:
    """One ready engine as :meth:`limits.slo_gate.SloGate.admit` reads it.

    Attributes:
        id: the engine's id (its ledger's key).
        load: requests on the engine, this process's and other clients' in its last
            report (``engines.plugins.engine_load``).
    """

    id: str
    load: int


class SloView(Protocol):
    """The SLO gate's read-only view for the scheduler's scorers
    (:class:`limits.slo_gate.SloGate` implements it)."""

    def pending_prefill_tokens(self, engine_id: str) -> int:
        """Uncached prompt tokens of this process's requests on the engine that have
        not had their first token (0 without a ledger)."""
        ...

    def predicted_ttft_s(self, engine_id: str, uncached_tokens: int) -> float | None:
        """Mean TTFT̂ of a request of ``uncached_tokens`` sent to the engine now, s
        (None without a ledger)."""
        ...
