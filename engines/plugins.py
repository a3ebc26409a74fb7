"""Scheduler plugins and the explicit registry that builds them from YAML.

Each role has an immutable mapping from the kebab-case ``type`` used in
``engines.yaml`` to a class; :func:`build_filter`, :func:`build_scorer` and
:func:`build_picker` construct one from a :class:`~config.schema.PluginConfig` with
``cls(**params)`` (pickers also get the scheduler's ``rng``). To add a plugin, write a
class that satisfies the protocol in :mod:`engines.interfaces` and add it to the
mapping of its role below.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from config.schema import PluginConfig
from engines.interfaces import Filter, Picker, SchedRequest, Scorer
from engines.pool import Engine


class LeastInFlight:
    """Prefers the engine with the fewest requests this gateway has in flight on it
    (the "least outstanding requests" balancing of NGINX ``least_conn`` and Envoy's
    least-request policy).

    Score = ``1 - in_flight / max_in_flight`` over the candidates, so the busiest
    engine scores 0 and an idle one 1; when no candidate has anything in flight every
    engine scores 1. No parameters.
    """

    def score(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[float]:
        busiest = max((e.in_flight for e in engines), default=0)
        if busiest <= 0:
            return [1.0] * len(engines)
        return [1.0 - max(e.in_flight, 0) / busiest for e in engines]


class MaxScore:
    """Picks the engine with the highest total score; ties (totals within
    ``tolerance``, default 1e-9) are broken uniformly at random with ``rng``."""

    def __init__(self, rng: random.Random, tolerance: float = 1e-9) -> None:
        self.rng = rng
        self.tolerance = tolerance

    def pick(self, engines: Sequence[Engine], totals: Sequence[float]) -> int:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t >= best - self.tolerance]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)


FILTERS: Mapping[str, type[Filter]] = MappingProxyType({})
SCORERS: Mapping[str, type[Scorer]] = MappingProxyType({
    "least-in-flight": LeastInFlight,
})
PICKERS: Mapping[str, type[Picker]] = MappingProxyType({
    "max-score": MaxScore,
})


def _build(role: str, registry: Mapping[str, type], cfg: PluginConfig, **extra: Any) -> Any:
    cls = registry.get(cfg.type)
    if cls is None:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"unknown {role} type {cfg.type!r} (known: {known})")
    try:
        return cls(**cfg.params, **extra)
    except TypeError as e:
        raise ValueError(f"{role} {cfg.type!r}: bad params {cfg.params!r}: {e}") from None


def build_filter(cfg: PluginConfig) -> Filter:
    """The filter named by ``cfg.type``.

    Raises:
        ValueError: unknown type (the message names it and lists the known ones), or
            params the class does not accept.
    """
    return _build("filter", FILTERS, cfg)


def build_scorer(cfg: PluginConfig) -> Scorer:
    """The scorer named by ``cfg.type``. Raises ValueError as :func:`build_filter`."""
    return _build("scorer", SCORERS, cfg)


def build_picker(cfg: PluginConfig, rng: random.Random) -> Picker:
    """The picker named by ``cfg.type``, given ``rng`` for random choices. Raises
    ValueError as :func:`build_filter`."""
    return _build("picker", PICKERS, cfg, rng=rng)
