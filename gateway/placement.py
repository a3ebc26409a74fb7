"""Placing one request on an engine: the candidates with room, the scheduler's pick,
and the engine lease it holds while the upstream call runs.

:class:`Placer` is synchronous and non-blocking (the admission queue calls
:meth:`Placer.place` while deciding which ticket goes next). A retry on another
engine before the first byte is an iteration over :meth:`Placer.attempts`: each
attempt is a fresh :class:`Placement` that excludes the engines already tried.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from config.schema import Priority
from engines.pool import Engine, EngineLease, EnginePool
from engines.scheduler import SchedRequest, Scheduler
from limits.interfaces import Clock
from limits.saturation import SaturationDetector, kv_blocks


@dataclass(eq=False)
class Placement:
    """One request's engine: its lease (one in-flight slot and ``lease.blocks``
    promised KV blocks, released exactly once) and the scheduler's scores and
    prefix prediction (:attr:`engines.scheduler.Decision.prefix_tokens`).

    ``async with placement:`` releases the lease on exit; :meth:`release` is
    idempotent, so the admission queue's undo and the exit may both run.
    """

    lease: EngineLease
    scores: dict[str, float] = field(default_factory=dict)
    prefix_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def engine(self) -> Engine:
        return self.lease.engine

    @property
    def blocks(self) -> int:
        return self.lease.blocks

    def release(self) -> None:
        self.lease.release()

    async def __aenter__(self) -> Placement:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Need:
    """What one request asks of an engine.

    Attributes:
        sched: the scheduler's view (model, prompt blocks, session…).
        priority: the tenant's priority (the saturation check's reserve).
        tokens: KV-cache tokens it may occupy: prompt + output cap × sequences.
    """

    sched: SchedRequest
    priority: Priority
    tokens: int


class Placer:
    """Chooses engines with room and takes their leases.

    Args:
        pool: the engines and their leases.
        scheduler: picks one engine among the candidates and records dispatches.
        detector: whether an engine has room for a request (KV blocks, in-flight cap).
        clock: monotonic time, s (the metrics snapshots' clock).
    """

    def __init__(self, *, pool: EnginePool, scheduler: Scheduler,
                 detector: SaturationDetector, clock: Clock) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.detector = detector
        self.clock = clock

    def candidates(self, model: str, priority: Priority, tokens: int,
                   exclude: frozenset[str] = frozenset()) -> list[Engine]:
        """Ready engines of ``model`` not in ``exclude`` with room for ``tokens``."""
        now = self.clock.now()
        return [e for e in self.pool.for_model(model)
                if e.routable and e.id not in exclude
                and self.detector.admits(e, priority, tokens, now)]

    def place(self, need: Need, exclude: frozenset[str] = frozenset()) -> Placement | None:
        """Pick an engine with room for ``need`` and lease it, or None when none has
        room now."""
        candidates = self.candidates(need.sched.model, need.priority, need.tokens, exclude)
        if not candidates:
            return None
        now = self.clock.now()
        decision = self.scheduler.pick(need.sched, candidates, now)
        if decision is None:
            return None
        blocks = kv_blocks(need.tokens, decision.engine.block_size)
        lease = self.pool.lease(decision.engine, blocks)
        self.scheduler.record(need.sched, decision.engine, now)
        return Placement(lease, decision.scores, decision.prefix_tokens)

    def attempts(self, first: Placement, need: Need, max_attempts: int) -> Iterator[Placement]:
        """``first``, then — each time the caller asks for another (its attempt failed
        before the first byte) — a new placement on an engine not tried yet, up to
        ``max_attempts`` in all; ends when none has room. The caller releases each
        placement it receives (``async with``)."""
        tried: set[str] = set()
        placement: Placement | None = first
        while placement is not None:
            tried.add(placement.engine.id)
            yield placement
            if len(tried) >= max_attempts:
                return
            placement = self.place(need, frozenset(tried))
