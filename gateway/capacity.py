"""The capacity report of one gateway (``GET /admin/capacity``, ``sluice capacity``,
the HPA's desired-engines metric): the fitted per-engine latency models, the observed
request mix and band demand, priced by :mod:`limits.capacity`
(docs/adaptive-admission.md)."""

from __future__ import annotations

from collections.abc import Mapping

from config.schema import PRIORITIES, AdaptiveConfig, SloConfig
from engines.pool import Engine, EnginePool
from limits import capacity
from limits.slo_gate import SloGate


def engine_kind(engine: Engine) -> str:
    """The serving engine behind ``engine``: its spec's ``kind`` (``vllm``,
    ``llamacpp``, ``sim``), or for an external one the dialect it speaks."""
    kind = engine.labels.get("kind", "external")
    return engine.labels.get("dialect", kind) if kind == "external" else kind


class CapacityReport:
    """Reads the live pool, mix and demand; no state of its own.

    Args:
        pool: the engines.
        gate: the SLO gate: each engine's fitted latency model (when adaptive) and
            each model's band demand (arrival rates).
        mix: per model, the prompt/output mix of finished requests.
        slo: the per-band TTFT/TPOT targets.
        adaptive: the adaptive-admission settings (``confidence_z``).
    """

    def __init__(self, *, pool: EnginePool, gate: SloGate,
                 mix: Mapping[str, capacity.MixTracker], slo: SloConfig,
                 adaptive: AdaptiveConfig) -> None:
        self.pool, self.gate, self.mix = pool, gate, mix
        self.slo, self.adaptive = slo, adaptive

    def _views(self, model: str) -> list[capacity.EngineView]:
        tightest = min(self.slo.target(p).tpot_s for p in PRIORITIES)
        gate = self.gate
        return [capacity.EngineView(e.id, e.labels.get("spec", e.id), fitted,
                                    gate.mode(e.id, tightest) or "", e.block_size,
                                    e.num_blocks, e.cost_per_hour, engine_kind(e),
                                    e.kv_capacity_tokens)
                for e in self.pool.for_model(model)
                if (fitted := gate.model(e.id)) is not None]

    def report(self, model: str, target_rate: float | None) -> dict[str, object]:
        """``GET /admin/capacity`` for one model (:func:`limits.capacity.report`);
        before any request finished, the mix is None and no engine is listed."""
        mix = self.mix[model].mix()
        if mix is None:
            return {"model": model, "mix": None, "engines": [], "target_rate": target_rate}
        slo = {p: (self.slo.target(p).ttft_s, self.slo.target(p).tpot_s) for p in PRIORITIES}
        rep = capacity.report(self._views(model), mix, slo, self.adaptive.confidence_z,
                              target_rate)
        return {"model": model, **rep}

    def desired_engines(self, model: str) -> float | None:
        """Engines the model's current arrival rate needs (the HPA metric), or None
        before any request finished."""
        mix = self.mix[model].mix()
        if mix is None:
            return None
        demand = self.gate.band_demand(model)
        rate = sum(demand.rate(p) for p in PRIORITIES)
        t = min((self.slo.target(p) for p in PRIORITIES), key=lambda t: t.tpot_s)
        return capacity.desired_engines(self._views(model), mix, t.ttft_s, t.tpot_s,
                                        self.adaptive.confidence_z, rate)
