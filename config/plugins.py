"""The schema of the scheduler plugins ``engines.yaml`` may name: for each role
(``filter``, ``scorer``, ``picker``) the kebab-case types and each type's pydantic
``Params`` model, which :class:`config.schema.PluginConfig` validates ``params``
against when the file loads.

The plugins themselves are :mod:`engines.plugins`; each class's ``Params`` is the
model registered here under its type, and ``tests/unit/test_routing_plugins.py``
checks that the two registries name the same types. To add a plugin, add its type (and
its ``Params``, if it takes any) here and its class there. Living here, the schema
needs nothing from ``engines`` (``config`` imports no other package:
``docs/architecture.md``, "Packages").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field


class NoParams(BaseModel):
    """Parameters of a plugin that takes none; any key is an error. Plugins with
    parameters subclass it (unknown keys stay errors, values are immutable)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class KvWatermarkParams(NoParams):
    """``kv-watermark`` (:class:`engines.plugins.KvWatermark`)."""

    watermark: float = Field(0.8, gt=0, le=1, description="KV-cache usage fraction 0-1")


class LoadGuardParams(NoParams):
    """``load-guard`` (:class:`engines.plugins.LoadGuard`)."""

    abs_threshold: float = Field(4.0, ge=0, description="requests")
    rel_threshold: float = Field(0.25, ge=0, description="fraction of the least load")


class MaxScoreParams(NoParams):
    """``max-score`` (:class:`engines.plugins.MaxScore`)."""

    tolerance: float = Field(1e-9, ge=0, description="score difference counted as a tie")


def _role(params: Mapping[str, type[NoParams]]) -> Mapping[str, type[NoParams]]:
    return MappingProxyType(dict(params))


#: role → type → its ``Params`` model.
PLUGIN_PARAMS: Mapping[str, Mapping[str, type[NoParams]]] = MappingProxyType({
    "filter": _role({"kv-watermark": KvWatermarkParams, "load-guard": LoadGuardParams}),
    "scorer": _role({name: NoParams for name in (
        "least-in-flight", "prefix-affinity", "kv-cache-usage", "queue-depth",
        "session-affinity", "predicted-ttft", "prefill-backlog")}),
    "picker": _role({"max-score": MaxScoreParams, "round-robin": NoParams}),
})


def plugin_params(role: str, type_: str) -> type[NoParams]:
    """The ``Params`` model of the plugin registered as ``type_`` for ``role``.

    Raises:
        ValueError: unknown type; the message lists the valid ones.
    """
    registry = PLUGIN_PARAMS[role]
    params = registry.get(type_)
    if params is None:
        valid = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"unknown {role} type {type_!r}; valid types: {valid}")
    return params
