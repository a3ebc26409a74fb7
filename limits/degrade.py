"""The degradation ladder: what a saturated model does to sheddable requests instead
of queueing them all.

Rungs, in order (``DegradationConfig`` per model in ``engines.yaml``; unconfigured
rungs are skipped): 1. cap the output length at ``max_tokens_cap``; 2. route to
``fallback_model`` (keeping the cap); past the last rung, 3. shed. The gateway climbs
one rung each time the request still cannot be placed — the brownout idea of
degrading optional work before refusing service (Klein et al., "Brownout: building
more robust cloud applications", ICSE 2014) applied as graceful degradation of
generation length and model size. Priorities not listed in ``sheddable`` are never
degraded.

This module decides; it knows no request format. The gateway applies a
:class:`Rung` to the request (``gateway.openai_api``) and raises :func:`shed`'s
rejection itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.schema import DegradationConfig, Priority
from limits.outcome import Outcome, Rejected

#: Response header naming the rungs applied.
DEGRADED_HEADER = "x-sluice-degraded"


@dataclass(frozen=True)
class Rung:
    """One step down the ladder: exactly one of the two is set.

    Attributes:
        cap_output: cap each generated sequence at this many tokens (a cap the
            request already has that is lower stays).
        fallback_model: serve the request with this model instead.
    """

    cap_output: int | None = None
    fallback_model: str | None = None


def ladder(config: DegradationConfig, priority: Priority) -> tuple[Rung, ...]:
    """The rungs a ``priority`` request may climb on a model configured with
    ``config``, in order; () for priorities not in ``config.sheddable``."""
    if priority not in config.sheddable:
        return ()
    rungs = []
    if config.max_tokens_cap is not None:
        rungs.append(Rung(cap_output=config.max_tokens_cap))
    if config.fallback_model is not None:
        rungs.append(Rung(fallback_model=config.fallback_model))
    return tuple(rungs)


def shed(model: str, priority: Priority, retry_after_s: float) -> Rejected:
    """The rejection for a request shed past the ladder's last rung:
    ``Outcome.OVERLOADED`` with reason ``"shed"`` and ``retry_after_s`` (s)."""
    return Rejected(
        Outcome.OVERLOADED,
        f"model {model!r} is saturated; {priority} requests are shed",
        retry_after_s=retry_after_s,
        reason="shed",
    )
