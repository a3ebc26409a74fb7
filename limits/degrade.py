"""The degradation ladder: what a saturated model does to sheddable requests instead
of queueing them all.

Rungs, in order (``DegradationConfig`` per model in ``engines.yaml``; unconfigured
rungs are skipped): 1. cap the output length at ``max_tokens_cap``; 2. route to
``fallback_model`` (keeping the cap); 3. shed. The gateway climbs one rung each time
the request still cannot be placed — the brownout idea of degrading optional work
before refusing service (Klein et al., "Brownout: building more robust cloud
applications", ICSE 2014) applied as graceful degradation of generation length and
model size. Priorities not listed in ``sheddable`` are never degraded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from config.schema import DegradationConfig, Priority
from limits.outcome import Outcome, Rejected

#: Response header naming the rungs applied.
DEGRADED_HEADER = "x-sluice-degraded"


@dataclass(frozen=True)
class Degraded:
    """A request body after the ladder.

    Attributes:
        body: the body to send upstream (a new dict; the input is not modified).
        actions: what changed, e.g. ``("max_tokens=256", "model=gemma-small")``.
    """

    body: dict[str, Any]
    actions: tuple[str, ...] = ()

    @property
    def header(self) -> str | None:
        """Value of :data:`DEGRADED_HEADER`, or None when nothing was applied."""
        return ", ".join(self.actions) or None


def degrade(
    body: Mapping[str, Any],
    *,
    priority: Priority,
    config: DegradationConfig,
    level: int,
    retry_after_s: float,
) -> Degraded:
    """Apply the first ``level`` rungs of the ladder to ``body``.

    Args:
        body: the OpenAI request body (``model``, ``max_tokens`` or
            ``max_completion_tokens``, …).
        priority: the request's priority; unless ``config.sheddable`` lists it, the
            body comes back unchanged at every level.
        config: the model's ``DegradationConfig``.
        level: rungs to apply; 0 applies none.
        retry_after_s: ``Retry-After`` for a shed request, s.

    The output cap goes on whichever of ``max_completion_tokens`` and ``max_tokens``
    the client used (``max_tokens`` when it used neither; both endpoints accept it).
    A body carrying both keeps only ``max_completion_tokens`` (the one OpenAI and
    vLLM honour), so the upstream never sees contradictory values.

    Raises:
        Rejected: ``Outcome.OVERLOADED`` with reason ``"shed"`` once ``level`` goes
            past the configured rungs.
    """
    out = dict(body)
    if level <= 0 or priority not in config.sheddable:
        return Degraded(out)
    rungs: list[Callable[[dict[str, Any]], str | None]] = []
    if config.max_tokens_cap is not None:
        cap = config.max_tokens_cap
        rungs.append(lambda b: _cap_output(b, cap))
    if config.fallback_model is not None:
        fallback = config.fallback_model
        rungs.append(lambda b: _route(b, fallback))
    if level > len(rungs):
        raise Rejected(
            Outcome.OVERLOADED,
            f"model {body.get('model')!r} is saturated; {priority} requests are shed",
            retry_after_s=retry_after_s,
            reason="shed",
        )
    actions = tuple(a for rung in rungs[:level] if (a := rung(out)) is not None)
    return Degraded(out, actions)


def _cap_output(body: dict[str, Any], cap: int) -> str | None:
    dropped = False
    if body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
        dropped = body.pop("max_tokens", None) is not None
    else:
        field = "max_tokens"
    asked = body.get(field)
    capped = cap if asked is None else min(asked, cap)
    if capped == asked and not dropped:
        return None
    body[field] = capped
    return f"{field}={capped}"


def _route(body: dict[str, Any], model: str) -> str | None:
    if body.get("model") == model:
        return None
    body["model"] = model
    return f"model={model}"
