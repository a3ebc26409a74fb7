"""Choose an engine for a request: filters → weighted scorers → one picker
(DESIGN.md, "Request flow" step 6).

The plugins come from ``SchedulerConfig`` through :mod:`engines.plugins`; the
scheduler itself knows only their protocols (:mod:`engines.interfaces`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from config.schema import SchedulerConfig
from engines.interfaces import SchedRequest
from engines.plugins import build_filter, build_picker, build_scorer
from engines.pool import Engine

__all__ = ["Decision", "SchedRequest", "Scheduler"]


@dataclass
class Decision:
    """The chosen engine and why.

    Attributes:
        engine: where the request goes.
        scores: the chosen engine's score from each scorer, keyed by the scorer's
            ``type`` (unweighted, 0–1; a type listed twice keeps its last entry),
            plus ``"total"``, the weighted sum.
    """

    engine: Engine
    scores: dict[str, float]


class Scheduler:
    """Places requests on engines.

    :meth:`pick` runs, in order:

    1. the built-in filter: engines that are routable (``ready``) and serve
       ``req.model`` — the "healthy list";
    2. the configured filters in sequence; if they remove every engine, the healthy
       list is used instead (a filter expresses a preference, never an outage);
    3. every configured scorer; an engine's total is the sum of ``weight × score``;
    4. the picker, given the totals.

    Args:
        cfg: plugin types, weights and params.
        rng: randomness for pickers (tie-breaks); default an unseeded ``Random``.

    Raises:
        ValueError: a plugin type is unknown or its params are invalid.
    """

    def __init__(self, cfg: SchedulerConfig, rng: random.Random | None = None) -> None:
        self.filters = [build_filter(f) for f in cfg.filters]
        self.scorers = [(s.type, s.weight, build_scorer(s)) for s in cfg.scorers]
        self.picker = build_picker(cfg.picker, rng or random.Random())

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
        return Decision(engine=candidates[i], scores=scores)
