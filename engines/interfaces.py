"""Protocols of the scheduler's plugins (DESIGN.md, "Request flow" step 6).

Plugins are pure: synchronous, no I/O, no waiting. Everything they need is in the
request and the :class:`~engines.pool.Engine` views (state, in-flight count, latest
metrics snapshot), plus ``now`` from the caller's clock for freshness checks.
Implementations are chosen by a kebab-case ``type`` through
:data:`engines.plugins.REGISTRY` and built with ``cls(**params)`` from YAML.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from config.schema import Priority
from engines.pool import Engine


@dataclass(frozen=True)
class SchedRequest:
    """What the scheduler knows about one request (re-exported by
    :mod:`engines.scheduler`).

    Attributes:
        model: served model name the client asked for.
        tenant: tenant name.
        prompt_tokens: estimated prompt length, tokens.
        blocks: chained hashes of the prompt's fixed-size token blocks (prefix
            affinity); empty when not computed.
        session_id: client conversation id, if any.
        priority: ``interactive``, ``standard`` or ``batch``.
    """

    model: str
    tenant: str
    prompt_tokens: int
    blocks: tuple[int, ...] = ()
    session_id: str | None = None
    priority: Priority = "standard"


class Filter(Protocol):
    """Keeps the engines that may take the request.

    Returns a subset of ``engines`` in their original order; may return an empty
    list (the scheduler then falls back to the unfiltered healthy list).
    """

    def filter(
        self, req: SchedRequest, engines: Sequence[Engine], now: float
    ) -> list[Engine]: ...


class Scorer(Protocol):
    """Rates each candidate engine for the request.

    Returns one score per engine, in the order given, each in [0, 1] (1 = best).
    The scheduler multiplies it by the scorer's configured ``weight``.
    """

    def score(
        self, req: SchedRequest, engines: Sequence[Engine], now: float
    ) -> list[float]: ...


class Picker(Protocol):
    """Chooses one engine from non-empty ``engines`` given their total scores
    (same order). Returns the index of the chosen engine."""

    def pick(self, engines: Sequence[Engine], totals: Sequence[float]) -> int: ...
