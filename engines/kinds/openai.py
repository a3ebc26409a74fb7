"""A generic OpenAI-compatible server with no load metrics (``dialect: openai``).

Nothing but ``/v1/models`` and the inference endpoints is assumed: readiness is
``GET /v1/models`` listing the model (``/health`` is tried first and a 404 there is
not a failure), the inference probe uses chat completions when ``/v1/completions``
answers 404, and the engine is admitted by the gateway's own in-flight accounting and
latency observations (the learned limit, starting at
``saturation.unmetered_max_in_flight``; ``limits.saturation``), never starved for want
of ``/metrics``.
"""

from __future__ import annotations

from engines.kinds import EngineKind

KIND = EngineKind(
    name="openai", metrics_path=None, parse=None, signals=frozenset(), health_path="",
    quirks="no load metrics; usage in streams only if it honours stream_options",
)
