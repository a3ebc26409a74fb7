"""Choose an engine for a request: filters → weighted scorers → one picker
(docs/architecture.md, "One request", step 10).

The plugins come from ``SchedulerConfig`` through :mod:`engines.plugins`; the
scheduler itself knows only their protocols (:mod:`engines.interfaces`). It owns the
routing state the plugins read — the :class:`~engines.prefix.PrefixIndex` and the
:class:`~engines.sessions.SessionTable` — and hands it to them inside the request
(``prefix_matches``, ``session_engine``), so the plugins stay pure.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from config.schema import SchedulerConfig
from engines.interfaces import SchedRequest
from engines.plugins import build_filter, build_picker, build_scorer
from engines.pool import Engine
from engines.prefix import PrefixIndex
from engines.prefix_events import EventPrefixIndex
from engines.sessions import SessionTable
from limits.interfaces import SloView

__all__ = ["Decision", "SchedRequest", "Scheduler", "engine_hit_blocks"]


def engine_hit_blocks(req: SchedRequest) -> int:
    """The most leading blocks an engine can serve ``req`` from its cache: vLLM
    recomputes the last prompt token to get logits, so at most
    ``(prompt_tokens − 1) // block_size`` blocks hit (``get_computed_blocks`` in
    ``vllm/v1/core/kv_cache_manager.py``); never more than ``req.blocks``. A
    ``prompt_tokens`` below the blocks' own token count (an estimate) is ignored."""
    if not req.block_size or req.prompt_tokens < len(req.blocks) * req.block_size:
        return len(req.blocks)
    return min(len(req.blocks), (req.prompt_tokens - 1) // req.block_size)


@dataclass
class Decision:
    """The chosen engine and why.

    Attributes:
        engine: where the request goes.
        scores: the chosen engine's score from each scorer, keyed by the scorer's
            ``type`` (unweighted, 0–1; a type listed twice keeps its last entry),
            plus ``"total"``, the weighted sum.
        prefix_tokens: prompt tokens the prefix index predicts the chosen engine
            holds, keyed by the index's source (``events`` or ``approximate``; with
            events also the approximate index's prediction), capped as the engine
            caps its hits (:func:`engine_hit_blocks`); empty without blocks.
    """

    engine: Engine
    scores: dict[str, float]
    prefix_tokens: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Places requests on engines.

    :meth:`pick` runs, in order:

    0. looks up, for every healthy engine, the leading prompt blocks the prefix index
       says it holds and the session's engine (into the request it gives plugins);
    1. the built-in filter: engines that are routable (``ready``) and serve
       ``req.model`` — the "healthy list";
    2. the configured filters in sequence; if they remove every engine, the healthy
       list is used instead (a filter expresses a preference, never an outage);
    3. every configured scorer; an engine's total is the sum of ``weight × score``;
    4. the picker, given the totals.

    :meth:`record` notes a dispatch (prefix index and session table); the caller
    invokes it once the request has a lease on the chosen engine.

    Args:
        cfg: plugin types, weights and params.
        rng: randomness for pickers (tie-breaks); default an unseeded ``Random``.

    Raises:
        ValueError: a plugin type is unknown or its params are invalid.
    """

    def __init__(self, cfg: SchedulerConfig, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        #: the SLO gate's view the scorers read (``SchedRequest.slo``); set by the
        #: gateway's placer
        self.slo: SloView | None = None
        self.set_plugins(cfg)
        p = cfg.prefix
        self.source = p.source
        self.index: PrefixIndex | EventPrefixIndex = (
            EventPrefixIndex(p.max_bytes, p.ttl_s, p.predicted_ttl_s, p.block_size)
            if p.source == "events" else PrefixIndex(p.max_bytes, p.ttl_s))
        self.sessions = SessionTable(cfg.sessions.max_sessions, cfg.sessions.ttl_s)

    def set_plugins(self, cfg: SchedulerConfig) -> None:
        """Build ``cfg``'s filters, scorers and picker (also on a reload: the plugins
        are pure, so the next pick uses the new ones). The prefix index and the
        session table are kept; their settings (``prefix``, ``sessions``) take
        effect on a restart.

        Raises:
            ValueError: a plugin type is unknown or its params are invalid.
        """
        self.filters = [build_filter(f) for f in cfg.filters]
        self.scorers = [(s.type, s.weight, build_scorer(s)) for s in cfg.scorers]
        self.picker = build_picker(cfg.picker, self.rng)

    def pick(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> Decision | None:
        """The engine for ``req`` among ``engines``, or None if no engine is ready
        for its model. Pure: reads the engines, changes nothing.

        Args:
            req: the request.
            engines: all known engines (typically ``pool.engines``).
            now: current clock time, s (same clock as the metrics snapshots).
        """
        healthy = [e for e in engines if e.routable and e.model == req.model]
        if not healthy:
            return None
        req = replace(
            req,
            prefix_matches={e.id: self.index.match(e, req.blocks, now) for e in healthy}
            if req.blocks else {},
            session_engine=self.sessions.engine_for(req.session_id, healthy, now),
            slo=self.slo,
        )
        candidates = healthy
        for f in self.filters:
            candidates = f.filter(req, candidates, now)
            if not candidates:
                candidates = healthy
                break
        rated = [
            (name, weight, scorer.score(req, candidates, now))
            for name, weight, scorer in self.scorers
        ]
        totals = [sum(w * values[i] for _, w, values in rated) for i in range(len(candidates))]
        i = self.picker.pick(candidates, totals)
        scores = {name: values[i] for name, _, values in rated}
        scores["total"] = totals[i]
        chosen = candidates[i]
        prefix: dict[str, int] = {}
        if req.blocks and req.block_size:
            cap = engine_hit_blocks(req)
            prefix[self.source] = min(req.prefix_matches.get(chosen.id, 0), cap) * req.block_size
            if isinstance(self.index, EventPrefixIndex):
                approx = self.index.approximate.match(chosen, req.blocks, now)
                prefix["approximate"] = min(approx, cap) * req.block_size
        return Decision(engine=chosen, scores=scores, prefix_tokens=prefix)

    def record(self, req: SchedRequest, engine: Engine, now: float) -> None:
        """``req`` was dispatched to ``engine`` at ``now`` (clock time, s): its blocks
        join the engine's prefix index entries, its session sticks to the engine."""
        self.index.record(engine, req.blocks, now, req.block_size or None)
        self.sessions.record(req.session_id, engine, now)
