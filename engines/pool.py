"""The fleet as the gateway sees it: one :class:`Engine` per running (or external)
engine process, its state, in-flight count and latest metrics snapshot.

The supervisor writes states, the metrics pollers write snapshots, the gateway takes
leases. Every change calls :meth:`EnginePool.notify` so waiters (the admission queue)
can retry placement without polling.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.breaker import CircuitBreaker
from engines.kv_events import EventsEndpoint
from limits.interfaces import EngineCounters


class EngineState(enum.Enum):
    """Life cycle: starting → ready ⇄ unhealthy → restarting → starting …;
    draining → stopped on shutdown or when a reload removes the engine. Only
    ``ready`` engines receive traffic."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of an engine's Prometheus ``/metrics`` (vLLM names).

    Attributes:
        at: clock time of the scrape, s (the pool's clock, monotonic).
        kv_cache_usage: ``vllm:kv_cache_usage_perc`` (or the older
            ``vllm:gpu_cache_usage_perc``), fraction 0–1; None if absent.
        num_running: ``vllm:num_requests_running``, requests.
        num_waiting: ``vllm:num_requests_waiting``, requests.
        prefix_cache_queries: ``vllm:prefix_cache_queries[_total]``, tokens (counter).
        prefix_cache_hits: ``vllm:prefix_cache_hits[_total]``, tokens (counter).
        generation_tokens: ``vllm:generation_tokens[_total]``, tokens (counter).
        block_size: tokens per KV block, from ``vllm:cache_config_info``.
        num_blocks: KV blocks one sequence may fill: ``kv_tokens // block_size`` where
            the engine exports ``kv_tokens``, else ``num_gpu_blocks`` of
            ``vllm:cache_config_info`` (:func:`engines.kinds.vllm.parse_metrics`).
        kv_tokens: the engine's own KV-cache capacity, tokens (vLLM's
            ``kv_cache_size_tokens`` label: a hybrid-attention model's pool divided
            among its KV-cache groups); None when not exported.
        signals: the load signals this scrape held (names in
            :data:`engines.kinds.SIGNALS`); other dialects map their own names onto
            the fields above (:mod:`engines.kinds`).
        counters: the engine's latency histograms and token counters (vLLM's), which
            the engine's latency model learns from; None when not exported.
    """

    at: float
    kv_cache_usage: float | None = None
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    generation_tokens: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    kv_tokens: int | None = None
    signals: frozenset[str] = frozenset()
    counters: EngineCounters | None = None


@dataclass(eq=False)
class Engine:
    """Runtime view of one engine.

    Attributes:
        id: unique name (``<spec name>`` or ``<spec name>-<replica>``).
        model: served model name.
        base_url: ``http://host:port`` (no trailing slash, no ``/v1``).
        state: current :class:`EngineState`.
        in_flight: requests this gateway process has sent and not finished.
        metrics: latest snapshot or None before the first scrape.
        in_flight_at_metrics: the part of the engine's reported load in ``metrics``
            that is this process's own: ``in_flight`` when the scrape was sent or
            when it was stored, whichever is larger (a request that ended during the
            round trip may still be on the page).
        in_flight_throughout: the fewer of ``in_flight`` when the scrape was sent and
            when it was stored: requests the page should count (:attr:`unreported`).
        generation: bumped on every (re)start; caches keyed on the engine's content
            (prefix index) drop entries from older generations.
        promised_blocks: KV blocks reserved by in-flight requests (limits' KV budget).
        restarts: restarts so far.
        metered: the engine has a load-metrics endpoint that answers (False for an
            engine without one, or whose endpoint is missing): admission then counts
            its in-flight requests instead of waiting for metrics.
        breaker: the engine's :class:`~engines.breaker.CircuitBreaker` (requests that
            timed out before their first token or could not connect open it).
        priority_scheduling: runs vLLM's ``--scheduling-policy priority`` (the
            gateway forwards the band as ``priority``).
        cost_per_hour: the spec's price per replica-hour, or None.
        slots: the most requests the engine runs at once, where it reports a fixed
            slot count (llama.cpp's ``/props`` ``total_slots``); None when unknown.
        slot_tokens: the context of one slot, tokens, where the engine has fixed slots
            (llama.cpp's ``/props`` ``default_generation_settings.n_ctx``: ``--ctx-size
            / --parallel``); the most KV one request may fill there. None when unknown.
        kv_events: where the engine publishes KV-cache events, if it does.
    """

    id: str
    model: str
    base_url: str
    state: EngineState = EngineState.STARTING
    in_flight: int = 0
    metrics: MetricsSnapshot | None = None
    in_flight_at_metrics: int = 0
    in_flight_throughout: int = 0
    generation: int = 0
    promised_blocks: int = 0
    restarts: int = 0
    metered: bool = True
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    labels: dict[str, str] = field(default_factory=dict)
    priority_scheduling: bool = False
    cost_per_hour: float | None = None
    kv_events: EventsEndpoint | None = None
    slots: int | None = None
    slot_tokens: int | None = None

    @property
    def routable(self) -> bool:
        """Ready, and its circuit breaker admits one more request."""
        return self.state is EngineState.READY and self.breaker.admits(self.in_flight)

    # The load view admission control reads (``limits.interfaces.EngineLoad``).
    @property
    def kv_cache_usage(self) -> float | None:
        return self.metrics.kv_cache_usage if self.metrics else None

    @property
    def num_waiting(self) -> int:
        return self.metrics.num_waiting if self.metrics else 0

    @property
    def block_size(self) -> int | None:
        return self.metrics.block_size if self.metrics else None

    @property
    def num_blocks(self) -> int | None:
        return self.metrics.num_blocks if self.metrics else None

    @property
    def metrics_at(self) -> float | None:
        return self.metrics.at if self.metrics else None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The most KV-cache tokens one request may fill on this engine, as the engine
        has it: one slot's context where it has fixed slots (:attr:`slot_tokens`),
        else its KV capacity (:attr:`num_blocks` × :attr:`block_size`, the engine's own
        token figure where it exports one); None when unknown."""
        if self.slot_tokens is not None:
            return self.slot_tokens
        if self.metrics is not None and self.metrics.kv_tokens:
            return self.metrics.kv_tokens
        if self.num_blocks and self.block_size:
            return self.num_blocks * self.block_size
        return None

    @property
    def unreported(self) -> int:
        """This gateway's requests on the engine that its last report counted neither
        running nor waiting: ``in_flight_throughout − running − waiting``, at least 0,
        where :attr:`in_flight_throughout` (the fewer of this gateway's requests in
        flight when the scrape was sent and when it was stored) are requests the page
        should have counted had they reached the engine's scheduler. They sit in its
        front end (vLLM's API server: HTTP, tokenisation, the queue to the engine core;
        llama.cpp's HTTP threads), which no engine metric counts, so they are load the
        gateway must see itself (``limits.saturation`` counts them as waiting).
        Requests sent since the scrape are not counted (the next scrape, one interval
        later, tells whether they reached the scheduler), so a burst on an engine
        that takes requests in at once is not held for an interval. 0 for an engine
        that reports no running count."""
        m = self.metrics
        if m is None or "running" not in m.signals:
            return 0
        return max(0, self.in_flight_throughout - m.num_running - m.num_waiting)


class EnginePool:
    """All engines, in configuration order.

    ``listeners`` are plain callables run synchronously on every :meth:`notify`; they
    must not block (typically they set an ``asyncio.Event``). ``on_add`` and
    ``on_remove`` callables receive each engine as it joins or leaves the pool (a
    reload adds and removes engines while the gateway runs): whoever keeps state per
    engine (latency ledger, KV-event subscriber, prefix index, metric series) starts
    or drops it there. ``on_counters`` callables receive (engine id, its scraped
    :class:`~limits.interfaces.EngineCounters`) on each :meth:`set_metrics` that has
    them (the SLO gate's latency ledgers learn from them).
    """

    def __init__(self, engines: list[Engine] | None = None) -> None:
        self.engines: list[Engine] = []
        self._by_model: dict[str, list[Engine]] = {}  # for_model on the request path
        self.listeners: list[Callable[[], None]] = []
        self.on_add: list[Callable[[Engine], None]] = []
        self.on_remove: list[Callable[[Engine], None]] = []
        self.on_counters: list[Callable[[str, EngineCounters], None]] = []
        for e in engines or ():
            self.add(e)

    def add(self, engine: Engine) -> None:
        """Add ``engine`` (its id must not be in the pool)."""
        self.engines.append(engine)
        self._by_model.setdefault(engine.model, []).append(engine)
        for fn in self.on_add:
            fn(engine)
        self.notify()

    def remove(self, engine: Engine) -> None:
        """Take ``engine`` out of the pool (no-op if it is not there). Leases still
        held on it release normally."""
        if engine not in self.engines:
            return
        self.engines.remove(engine)
        same = self._by_model[engine.model]
        same.remove(engine)
        if not same:
            del self._by_model[engine.model]
        for fn in self.on_remove:
            fn(engine)
        self.notify()

    def get(self, engine_id: str) -> Engine | None:
        return next((e for e in self.engines if e.id == engine_id), None)

    def for_model(self, model: str) -> list[Engine]:
        """The engines serving ``model`` (do not modify the list)."""
        return self._by_model.get(model, [])

    def ready_models(self) -> list[str]:
        """Models with at least one ready engine (whatever its circuit breaker says: a
        breaker opens for seconds), in configuration order."""
        return list(dict.fromkeys(e.model for e in self.engines if e.state is EngineState.READY))

    def set_state(self, engine: Engine, state: EngineState) -> None:
        if engine.state is not state:
            engine.state = state
            self.notify()

    def set_metrics(self, engine: Engine, snapshot: MetricsSnapshot,
                    in_flight_at_send: int = 0) -> None:
        """Store ``snapshot``; its histograms and counters go to :attr:`on_counters`
        (the SLO gate's latency ledgers).
        ``in_flight_at_send``: ``engine.in_flight`` when the scrape was sent (see
        :attr:`Engine.in_flight_at_metrics`)."""
        engine.metrics = snapshot
        engine.in_flight_at_metrics = max(in_flight_at_send, engine.in_flight)
        engine.in_flight_throughout = min(in_flight_at_send, engine.in_flight)
        if snapshot.counters is not None:
            for fn in self.on_counters:
                fn(engine.id, snapshot.counters)
        self.notify()

    def lease(self, engine: Engine, blocks: int = 0) -> EngineLease:
        """Count one in-flight request and ``blocks`` promised KV blocks on ``engine``
        until the returned lease is released (the one way to take engine capacity)."""
        engine.in_flight += 1
        engine.promised_blocks += blocks
        return EngineLease(self, engine, blocks)

    def _give_back(self, engine: Engine, blocks: int) -> None:
        engine.in_flight -= 1
        engine.promised_blocks -= blocks
        self.notify()

    def notify(self) -> None:
        for fn in self.listeners:
            fn()


class EngineLease:
    """One request's hold on an engine: one in-flight slot and ``blocks`` promised KV
    blocks. :meth:`release` gives them back exactly once, however often it is called;
    usable as ``with lease:`` or ``async with lease:`` (released on exit).

    Attributes:
        engine: the engine held.
        blocks: promised KV blocks, blocks.
        released: whether :meth:`release` ran.
    """

    def __init__(self, pool: EnginePool, engine: Engine, blocks: int) -> None:
        self.engine = engine
        self.blocks = blocks
        self.released = False
        self._pool = pool

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._give_back(self.engine, self.blocks)

    def __enter__(self) -> EngineLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> EngineLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
