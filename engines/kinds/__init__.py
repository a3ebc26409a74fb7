"""Engine kinds: what Sluice knows about each serving engine it launches or routes to.

One :class:`EngineKind` per dialect (``vllm``, ``llamacpp``, ``sglang``, ``tgi``,
``trtllm``, ``openai``): where its load metrics live and how to read them into the one
:class:`~engines.pool.MetricsSnapshot` that admission (``limits.saturation``) and the
scheduler's plugins already use, its health probes, the request fields it accepts and
how its errors map. Each module's docstring cites the metric names and endpoints with the
upstream version they were read from.

Signals (``MetricsSnapshot.signals``): ``kv_usage`` (KV-cache usage fraction 0–1),
``running``, ``waiting`` (requests), ``prefix_hits`` (prefix-cache hit and query
counters, tokens), ``block_size``, ``num_blocks``. A dialect that lacks a signal, or a
page that lacks one its dialect should have, degrades clearly: the engine is still
admitted, by the gateway's own in-flight accounting and latency observations (with
adaptive admission the learned concurrency limit of :mod:`limits.engine_latency`,
starting at ``saturation.unmetered_max_in_flight``; without it that fixed number;
``limits.saturation``), capped at the engine's slots where it reports them
(``slots_path``); a log line names the missing signals once per change, and the
gateway's ``sluice_engine_signals{engine,signal}`` gauge shows 1/0 per signal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from config.schema import EngineSpec
from engines.pool import MetricsSnapshot

#: Every load signal Sluice can read from an engine, in display order.
SIGNALS: tuple[str, ...] = ("kv_usage", "running", "waiting", "prefix_hits", "block_size",
                            "num_blocks")

#: ``parse(body, at, previous)``: the body of the metrics endpoint, the clock time of the
#: scrape (s) and the engine's previous snapshot (None before the first) → a snapshot
#: whose ``signals`` names what the body held. Raises ValueError on an unreadable body.
Parser = Callable[[str, float, "MetricsSnapshot | None"], MetricsSnapshot]


@dataclass(frozen=True)
class EngineKind:
    """One serving engine's dialect.

    Attributes:
        name: the dialect name (``EngineSpec.dialect``).
        metrics_path: path of the load-metrics endpoint; None when the engine has none
            (the engine is admitted by the gateway's own accounting only).
        parse: reads that endpoint's body (:data:`Parser`); None with no endpoint.
        slots_path: path of a JSON endpoint giving the most requests the engine runs at
            once (a fixed slot count, as llama.cpp's ``--parallel``); None when the
            engine has none.
        parse_slots: that endpoint's decoded JSON → the slot count (None when absent).
        signals: the signals this dialect reports when its endpoint is healthy.
        health_path: liveness/readiness path answering 200 once the model is loaded.
        probe_endpoint: ``completions`` or ``chat``: the endpoint of the 1-token
            inference probe (a chat-only server has no ``/v1/completions``).
        accepts: request fields beyond the OpenAI core the engine accepts:
            ``cache_salt`` (vLLM's per-request prefix-cache salt), ``priority``
            (per-request scheduling priority), ``stream_options`` (usage in streams).
        close_after_stream: the server closes the connection after a streamed answer
            (though it announces keep-alive): the gateway sends ``Connection: close``
            on streams so no pooled connection is reused dead.
        quirks: one line on usage/error behaviour that differs from vLLM's.
    """

    name: str
    metrics_path: str | None
    parse: Parser | None
    signals: frozenset[str]
    health_path: str = "/health"
    probe_endpoint: Literal["completions", "chat"] = "completions"
    accepts: frozenset[str] = frozenset({"stream_options"})
    close_after_stream: bool = False
    quirks: str = ""
    slots_path: str | None = None
    parse_slots: Callable[[Any], int | None] | None = None


def accepts_cache_salt(spec: EngineSpec) -> bool:
    """Whether requests to this engine may carry ``cache_salt``: ``spec.cache_salt``
    when set, else whether its dialect accepts the field (vLLM ≥ 0.9 and the simulator
    in vLLM's dialect do) and Sluice launched it (an ``external`` server is not assumed
    to)."""
    if spec.cache_salt is not None:
        return spec.cache_salt
    return spec.kind != "external" and "cache_salt" in KINDS[spec.engine_dialect].accepts


def present(**found: bool) -> frozenset[str]:
    """The signal names whose flag is true: ``present(kv_usage=True, running=False)``."""
    return frozenset(name for name, ok in found.items() if ok)


from engines.kinds import llamacpp, openai, sglang, tgi, trtllm, vllm  # noqa: E402

#: Every dialect by name (``EngineSpec.dialect``).
KINDS: dict[str, EngineKind] = {k.name: k for k in (
    vllm.KIND, llamacpp.KIND, sglang.KIND, tgi.KIND, trtllm.KIND, openai.KIND)}
