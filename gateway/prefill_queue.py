"""The gateway's queue of prefills per engine of a split model: prefill legs beyond
one step's worth of prefill outstanding on a prefill engine, and local prefills
beyond a decode engine's per-step budget, wait here and leave in an order that
serves short prompts first without making one that would have started in time start
late.

Why: an engine serves its waiting requests first come, first served (vLLM's default
``--scheduling-policy fcfs``), so in a burst a 200-token prompt waits behind every
long prompt sent before it. Shortest processing time first minimises the mean wait
of a single server (Smith's rule, Naval Research Logistics Quarterly 3, 1956); held
to deadlines, it must not cost a prefill its start. What may be sent depends on the
engine's role:

* a **prefill engine** gets legs only while it has fewer than ``hold_tokens`` prompt
  tokens outstanding (sent and not yet past their first token; default vLLM's
  ``max_num_batched_tokens`` of 8192 for large GPUs, ``vllm/engine/arg_utils.py``, so
  that every engine step can still be filled);
* a **decode engine** gets a prefill only when it fits its per-step budget
  (``step_tokens``, :meth:`gateway.disagg.Disaggregator.step_tokens`): the
  outstanding tokens plus its own are at most the budget, or nothing is
  outstanding. vLLM's chunked prefill puts every waiting prompt token it can
  (``max_num_batched_tokens``) into the next step, and every stream decoding there
  waits for that step, so the budget is what bounds the steps its streams see
  (Sarathi-Serve's token budget, Agrawal et al., OSDI 2024, §4).

Each release picks, among the held prefills:

1. the schedule of the held prefills in order of their latest start (EDF; Liu &
   Layland, JACM 1973), starting after the engine's outstanding work, gives each
   one's start and slack (latest start less start); those that start in time there
   are protected, and so are those already past their latest start (at best effort,
   not shed: with slack 0, so that nothing overtakes them and none starves);
2. the one released is the shortest (fewest tokens; then the earliest held) whose
   prefill time is at most the least slack of the protected ones ahead of it in that
   schedule: going first delays exactly those by its prefill time, so every protected
   one still starts in time. The first of the schedule always qualifies, so the queue
   never stalls. On a decode engine it leaves once it fits the budget.

A held prefill past its latest start, when it may be shed (the estimate is observed
and the prompt alone could meet its target), is shed at the next release (a prefill
on the engine reached its first token or ended): served, it would miss its TTFT
target and delay the prefills behind it, which can still make theirs.

Times are the injected clock's, s; prefill time per token is the engine's observed
:class:`gateway.disagg.PrefillSpeed`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.pool import Engine
from limits.interfaces import Clock

#: vLLM's ``max_num_batched_tokens`` default for GPUs with ≥ 70 GiB
#: (``vllm/engine/arg_utils.py``, ``_get_default_max_num_seqs_and_batched_tokens``).
DEFAULT_HOLD_TOKENS = 8192


class LegShed(Exception):
    """A held prefill was shed: it could no longer start in time (``args[0]``: how
    late it already was, s)."""


@dataclass(eq=False)
class HeldLeg:
    """One prefill (a split request's prefill leg, or a whole request's prompt on a
    decode engine) waiting at the gateway.

    Attributes:
        tokens: prompt tokens the engine computes.
        start_by: the latest clock time it may start and meet its TTFT target, s.
        sheddable: whether it is shed once past ``start_by``.
        seq: order of arrival in the queue.
        released: resolved when it may be sent (an exception: it was shed).
    """

    tokens: int
    start_by: float
    sheddable: bool
    seq: int
    released: asyncio.Future[None] = field(repr=False)


def pick(held: list[HeldLeg], now: float, backlog_s: float,
         s_per_token: float) -> HeldLeg:
    """The leg to release next among ``held`` (non-empty): the module docstring's
    rule, for an engine whose outstanding prefill ends ``backlog_s`` after ``now``
    (s) at ``s_per_token`` seconds per token. O(n log n) in the held legs."""
    least_slack = float("inf")  # over the protected legs ahead in the schedule
    allowed: dict[HeldLeg, float] = {}  # the delay the legs ahead of a leg allow, s
    t = now + backlog_s
    for h in sorted(held, key=lambda h: (h.start_by, h.seq)):
        allowed[h] = least_slack
        if h.start_by < now:  # already late: served in order
            least_slack = 0.0
        elif t <= h.start_by:
            least_slack = min(least_slack, h.start_by - t)
        t += h.tokens * s_per_token
    # the schedule's first leg is allowed any delay, so one always qualifies
    return min((h for h in held if h.tokens * s_per_token <= allowed[h]),
               key=lambda h: (h.tokens, h.seq))


class PrefillQueue:
    """Held prefills per engine (module docstring).

    Args:
        outstanding: engine → prompt tokens sent to it and not yet past their first
            token (:attr:`gateway.disagg.PrefillSpeed.outstanding`).
        s_per_token: engine → its seconds per prefill token.
        clock: monotonic time, s.
        hold_tokens: outstanding tokens from which a prefill engine's legs are held.
        step_tokens: engine → the prefill tokens one of its steps may carry (a
            decode engine's budget), or None for an engine held by ``hold_tokens``
            (default: every engine).
    """

    def __init__(self, outstanding: dict[str, int], s_per_token: Callable[[Engine], float],
                 clock: Clock, *, hold_tokens: int = DEFAULT_HOLD_TOKENS,
                 step_tokens: Callable[[Engine], float | None] = lambda _e: None) -> None:
        self.outstanding = outstanding
        self.s_per_token = s_per_token
        self.clock = clock
        self.hold_tokens = hold_tokens
        self.step_tokens = step_tokens
        self.held: dict[str, list[HeldLeg]] = {}
        self._reserved: dict[str, int] = {}  # released, not yet sent: tokens
        self._seq = itertools.count()

    def _load(self, engine_id: str) -> int:
        return self.outstanding.get(engine_id, 0) + self._reserved.get(engine_id, 0)

    def _fits(self, engine: Engine, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` may be sent to ``engine`` now."""
        load = self._load(engine.id)
        step = self.step_tokens(engine)
        if step is None:
            return load < self.hold_tokens
        return load == 0 or load + tokens <= step

    def wait_s(self, engine: Engine, tokens: int) -> float:
        """Predicted wait before a new prefill of ``tokens`` starts on ``engine``, s:
        the outstanding prefill plus the held ones no longer than it (they leave before
        it; longer ones leave after it unless their deadline forces them ahead)."""
        ahead = self._load(engine.id) + sum(
            h.tokens for h in self.held.get(engine.id, ()) if h.tokens <= tokens)
        return ahead * self.s_per_token(engine)

    async def admit(self, engine: Engine, tokens: int, start_by: float = float("inf"),
                    sheddable: bool = False) -> Callable[[], None]:
        """Wait until a prefill of ``tokens`` may be sent to ``engine``; returns the
        callback to call once it is counted as outstanding (or it ended), which frees
        its place in the release.

        Raises:
            LegShed: it was shed (past its latest start).
            asyncio.CancelledError: the caller was cancelled (it leaves the queue).
        """
        held = self.held.setdefault(engine.id, [])
        if not held and self._fits(engine, tokens):
            self._reserved[engine.id] = self._reserved.get(engine.id, 0) + tokens
            return self._placed(engine, tokens)
        leg = HeldLeg(tokens, start_by, sheddable, next(self._seq),
                      asyncio.get_running_loop().create_future())
        held.append(leg)
        try:
            await leg.released
        except asyncio.CancelledError:
            if leg in held:
                held.remove(leg)
            elif leg.released.done() and not leg.released.cancelled():
                self._unreserve(engine, tokens)  # released as we were cancelled
            raise
        return self._placed(engine, tokens)  # release() reserved its place

    def _placed(self, engine: Engine, tokens: int) -> Callable[[], None]:
        """The callback that frees the place reserved for a leg of ``tokens``."""
        done = False

        def sent() -> None:
            nonlocal done
            if not done:
                done = True
                self._unreserve(engine, tokens)
        return sent

    def _unreserve(self, engine: Engine, tokens: int) -> None:
        self._reserved[engine.id] = max(0, self._reserved.get(engine.id, 0) - tokens)
        self.release(engine)

    def release(self, engine: Engine) -> None:
        """Release held prefills of ``engine`` while it has room (call whenever its
        outstanding prefill falls), shedding those past their latest start."""
        engine_id = engine.id
        held = self.held.get(engine_id)
        if not held:
            return
        held[:] = [h for h in held if not h.released.done()]  # cancelled, not yet gone
        now = self.clock.now()
        for leg in [h for h in held if h.sheddable and h.start_by < now]:
            held.remove(leg)
            leg.released.set_exception(LegShed(now - leg.start_by))
        c = self.s_per_token(engine)
        while held and self._fits(engine, 0):  # room for any prefill at all
            leg = pick(held, now, self._load(engine_id) * c, c)
            if not self._fits(engine, leg.tokens):
                break
            held.remove(leg)
            self._reserved[engine_id] = self._reserved.get(engine_id, 0) + leg.tokens
            leg.released.set_result(None)

    def forget(self, engine_id: str) -> None:
        """An engine left the pool: its held prefills are released (their attempt
        fails there and moves on)."""
        for leg in self.held.pop(engine_id, []):
            leg.released.set_result(None)
        self._reserved.pop(engine_id, None)
