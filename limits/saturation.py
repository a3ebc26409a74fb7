"""Whether an engine may take one more request now, judged from its metrics and the
KV blocks already promised to requests in flight.

An engine admits a request of ``tokens`` (prompt estimate + max output) for a
priority when all hold:

1. its metrics are fresh: scraped at most ``stale_s`` ago (missing or stale metrics
   count as saturated, so a hung scraper never hides an overloaded engine) — unless
   the engine is unmetered (no load-metrics endpoint: ``EngineLoad.metered`` false);
2. its KV-cache usage is under the watermark: ``watermark`` for interactive and
   standard, ``batch_watermark`` for batch. An engine that reports no usage (llama.cpp,
   TGI, an unmetered server) is judged by the gateway's own accounting instead, so a
   missing metric never starves it: with adaptive admission (``learned``) by the
   concurrency limit the gateway learns from its own latency observations of that
   engine (TTFT, TPOT, usage; :mod:`limits.engine_latency`, applied by
   ``gateway.placement``; its fallback limiter starts at ``unmetered_max_in_flight``),
   so nothing here caps it; without adaptive admission by a fixed cap of
   ``unmetered_max_in_flight`` requests in flight (the concurrency limit of a
   closed-loop admission controller);
3. at most ``max_waiting`` requests wait inside the engine (a growing engine queue
   means its scheduler has no room; the gateway's queue orders them better): those
   its report counts waiting, plus this gateway's requests it counts neither running
   nor waiting (``EngineLoad.unreported``: held in its front end — vLLM's API server
   parsing, tokenising and handing them to the engine core, llama.cpp's HTTP
   threads — where no engine metric sees them; under a burst of hundreds of
   clients the packaged vLLM engine reported 1–2 running and 0 waiting while
   hundreds of requests sat there, and answered none of them within 60 s);
4. when ``max_in_flight`` is set, fewer than that many of this gateway's requests
   run on the engine: decode time per step grows with the batch, so the batch size
   that still meets the TPOT SLO is a hard cap (the concurrency limit of a
   closed-loop admission controller; vLLM's ``--max-num-seqs`` plays the same role
   inside the engine, where the excess would wait unordered); standard and batch
   requests stop ``interactive_reserve`` slots earlier, so a burst of interactive
   requests finds a slot at once instead of waiting for one to free (the KV
   headroom below, applied to batch slots);
5. when the engine reports a fixed slot count (``EngineLoad.slots``: llama.cpp's
   ``--parallel``), fewer than that many of this gateway's requests run on it — more
   would only wait inside the engine, unordered, where the gateway's queue orders
   them by priority and tenant share;
6. when block size and count are known, the request's blocks
   ``ceil(tokens / block_size)`` fit ``num_blocks × (ceiling − usage) −
   promised_blocks``, where the ceiling is 1.0, or ``batch_watermark`` for batch.

The lower batch watermark keeps headroom (default 20 % of the KV cache) for online
traffic, so a batch flood cannot fill the cache and force preemption of interactive
requests — the practice of reserving KV headroom for high-priority requests in
Llumnix (Sun et al., "Llumnix: Dynamic Scheduling for Large Language Model
Serving", OSDI 2024), and the same idea as the free-block watermark vLLM's block
manager keeps to avoid preemption. ``promised_blocks`` double-counts blocks an
in-flight request has already filled (they are in ``usage`` too): the check errs on
the safe side.
"""

from __future__ import annotations

import math

from config.schema import EnginesConfig, Priority
from limits.interfaces import EngineLoad


def kv_blocks(tokens: int, block_size: int | None) -> int:
    """KV blocks a request of ``tokens`` tokens may fill: ``ceil(tokens / block_size)``;
    0 when the block size is unknown."""
    return math.ceil(tokens / block_size) if block_size else 0


class SaturationDetector:
    """The saturation rules above.

    Args:
        watermark: KV usage fraction (0–1) from which an engine takes no more
            interactive or standard requests (default 0.9).
        batch_watermark: the same for batch requests (default 0.8).
        max_waiting: most requests waiting inside the engine (default 4).
        stale_s: oldest usable metrics, s (default 5).
        max_in_flight: most requests in flight per engine, or None (default) for no cap.
        interactive_reserve: slots of ``max_in_flight`` that only interactive requests
            may take (default 0).
        unmetered_max_in_flight: most requests in flight on an engine that reports no
            KV-cache usage when ``learned`` is false; the learned limit's starting
            point otherwise (default 4).
        learned: adaptive admission governs each engine's concurrency (``saturation.
            adaptive.enabled``): no fixed cap for an engine without KV usage
            (default False).
    """

    def __init__(self, watermark: float = 0.9, batch_watermark: float = 0.8,
                 max_waiting: int = 4, stale_s: float = 5.0,
                 max_in_flight: int | None = None, interactive_reserve: int = 0,
                 unmetered_max_in_flight: int = 4, learned: bool = False) -> None:
        self.watermark = watermark
        self.batch_watermark = batch_watermark
        self.max_waiting = max_waiting
        self.stale_s = stale_s
        self.max_in_flight = max_in_flight
        self.interactive_reserve = interactive_reserve
        self.unmetered_max_in_flight = unmetered_max_in_flight
        self.learned = learned

    @classmethod
    def from_config(cls, engines: EnginesConfig) -> SaturationDetector:
        """From ``engines.yaml``: the ``saturation`` section (``learned`` is
        ``adaptive.enabled``) and ``supervisor.metrics_stale_s``."""
        s = engines.saturation
        return cls(s.kv_watermark, s.batch_kv_watermark, s.max_waiting,
                   engines.supervisor.metrics_stale_s, s.max_in_flight, s.interactive_reserve,
                   s.unmetered_max_in_flight, s.adaptive.enabled)

    def admits(self, load: EngineLoad, priority: Priority, tokens: int, now: float) -> bool:
        """Whether ``load``'s engine may take a ``priority`` request of ``tokens``
        tokens (prompt + max output) at clock time ``now`` (s, the metrics' clock)."""
        usage = load.kv_cache_usage
        fresh = load.metrics_at is not None and now - load.metrics_at <= self.stale_s
        if not fresh and load.metered:
            return False
        if fresh and load.num_waiting + load.unreported > self.max_waiting:
            return False
        if load.slots is not None and load.in_flight >= load.slots:
            return False
        if usage is None or not fresh:  # no usage reported: our own accounting
            cap = math.inf if self.learned else self.unmetered_max_in_flight
            if self.max_in_flight is not None:
                cap = min(cap, self.max_in_flight)
            return load.in_flight < cap
        if self.max_in_flight is not None:
            cap = self.max_in_flight - (0 if priority == "interactive" else self.interactive_reserve)
            if load.in_flight >= cap:
                return False
        batch = priority == "batch"
        if usage >= (self.batch_watermark if batch else self.watermark):
            return False
        if load.block_size and load.num_blocks:
            ceiling = self.batch_watermark if batch else 1.0
            free = math.floor(load.num_blocks * (ceiling - usage)) - load.promised_blocks
            return kv_blocks(tokens, load.block_size) <= free
        return True
