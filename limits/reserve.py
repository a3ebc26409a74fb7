"""Adaptive interactive reserve: in-flight slots of a model kept for the interactive
demand the gateway has recently seen, so standard and batch streams cannot take the
slots an interactive burst is about to need.

A fixed per-engine reserve (``saturation.interactive_reserve``) is right only for one
load: when interactive traffic alone needs most of the engines, standard and batch
streams admitted into the unreserved slots hold them for a whole generation (~10 s)
while interactive tickets queue past their TTFT SLO; when interactive is quiet the
reserve idles. This reserve follows the demand instead.

Algorithm, per model (slots ``S`` = Σ ``max_in_flight`` over its routable engines):

1. Interactive demand ``d`` = interactive requests of this gateway in flight on the
   model + interactive tickets waiting in its queue (requests, sampled whenever
   placement is tried and whenever a request starts or ends).
2. Estimate ``D`` = an asymmetric EWMA of ``d`` (requests): it rises to ``d`` at once
   and decays towards it with time constant ``tau_s`` — the peak-hold ("fast attack,
   slow release") form, so a burst is reserved for at once, and slots are handed back
   to other classes only after it has been gone for ~``tau_s``. ``tau_s`` defaults to
   10 s, about one generation (128 tokens at ~80 ms): demand seen within the last
   generation is still holding or about to need slots.
3. Reserve ``R = min(S, ceil(D + headroom_sd × sqrt(D)))`` slots (0 when ``D`` = 0):
   the number of requests in service in an M/G/∞ system is Poisson with mean ``D``,
   hence standard deviation ``sqrt(D)`` — ``headroom_sd`` (default 1) standard
   deviations cover the usual fluctuation of interactive arrivals over the next
   generation.
4. A standard or batch request may take a slot only when no interactive ticket waits
   for the model and, after taking it, standard and batch together hold at most
   ``S − R`` slots of the model. Interactive requests are never held back here.

When the reserve says no, the request is "saturated" for the degradation ladder
(``gateway.director._degrade``): sheddable requests are capped, rerouted or shed
early while interactive traffic needs the engines, instead of waiting in the queue.

The static per-engine ``interactive_reserve`` still applies on top (a floor on each
engine). Running streams are not preempted.

Off by default (``saturation.adaptive_reserve``). Measured on the overload benchmark
(``python -m loadtest overload --quick``, 3x, one arrival sequence of 116 interactive
requests): interactive SLO attainment 85.3 % with it, 87.9 % without — no gain there,
because strict priority in the queue, the static reserve and early shedding already
keep standard and batch off the engines after the first seconds, and interactive
alone then fills every slot. It is meant for mixes where long standard/batch streams
hold slots when an interactive burst arrives; enable it where that is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from config.schema import Priority


@dataclass
class _ModelState:
    interactive: int = 0  # interactive requests in flight
    others: int = 0  # standard and batch requests in flight
    estimate: float = 0.0  # D, requests
    at: float | None = None  # clock time of the estimate, s


class InteractiveReserve:
    """The reserve above, for every model of one gateway process.

    Args:
        tau_s: decay time constant of the demand estimate, s (default 10).
        headroom_sd: standard deviations of Poisson headroom over the estimate
            (default 1.0; 0 reserves the estimate alone).
    """

    def __init__(self, tau_s: float = 10.0, headroom_sd: float = 1.0) -> None:
        self.tau_s = tau_s
        self.headroom_sd = headroom_sd
        self._models: dict[str, _ModelState] = {}

    def _state(self, model: str) -> _ModelState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelState()
        return state

    def started(self, model: str, priority: Priority) -> None:
        """A ``priority`` request took a slot of ``model``."""
        state = self._state(model)
        if priority == "interactive":
            state.interactive += 1
        else:
            state.others += 1

    def finished(self, model: str, priority: Priority) -> None:
        """A ``priority`` request gave its slot of ``model`` back."""
        state = self._state(model)
        if priority == "interactive":
            state.interactive -= 1
        else:
            state.others -= 1

    def observe(self, model: str, waiting: int, now: float) -> float:
        """Update and return the demand estimate ``D`` of ``model`` (requests), with
        ``waiting`` interactive tickets queued, at clock time ``now`` (s)."""
        state = self._state(model)
        demand = state.interactive + waiting
        if state.at is None or state.estimate <= demand:
            state.estimate = float(demand)
        else:
            decay = math.exp(-max(0.0, now - state.at) / self.tau_s)
            state.estimate = demand + (state.estimate - demand) * decay
        state.at = now
        return state.estimate

    def reserved(self, model: str, slots: int) -> int:
        """Slots ``R`` kept for interactive requests of ``model`` out of ``slots``, from
        the last :meth:`observe`."""
        d = self._state(model).estimate
        if d <= 0:
            return 0
        return min(slots, math.ceil(d + self.headroom_sd * math.sqrt(d) - 1e-9))

    def admits(self, model: str, priority: Priority, slots: int, waiting: int,
               now: float) -> bool:
        """Whether a ``priority`` request of ``model`` may take one of ``slots``
        slots (Σ ``max_in_flight`` of the model's routable engines) while ``waiting``
        interactive tickets wait, at clock time ``now`` (s)."""
        self.observe(model, waiting, now)
        if priority == "interactive":
            return True
        if waiting:
            return False
        return self._state(model).others + 1 <= slots - self.reserved(model, slots)

    def in_flight(self, model: str) -> dict[str, int]:
        """In-flight requests of ``model`` by class (for tests and metrics)."""
        state = self._state(model)
        return {"interactive": state.interactive, "others": state.others}

