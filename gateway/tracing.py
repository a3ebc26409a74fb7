"""OpenTelemetry traces: one server span per request, with child spans for the cache
lookup, the rate-limit reservation, the queue wait, scheduling and the upstream call
(which carries a ``first_token`` event); the W3C ``traceparent`` goes to the engine
(vLLM accepts it with ``--otlp-traces-endpoint``).

Attributes follow the OpenTelemetry GenAI semantic conventions
(https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/): span name
``"{gen_ai.operation.name} {gen_ai.request.model}"``, ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``gen_ai.response.finish_reasons``; Sluice's own facts under ``sluice.*``. No prompt or
answer text is recorded.

Spans are exported over OTLP/HTTP when ``observability.otlp_endpoint`` is set, to an
injected exporter in tests, and otherwise not made at all.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from config.schema import ObservabilityConfig
from gateway.record import RequestRecord

PROPAGATOR = TraceContextTextMapPropagator()
#: Inference endpoint → OpenTelemetry GenAI ``gen_ai.operation.name`` (semantic
#: conventions: ``chat``, ``text_completion``, ``embeddings``, ``generate_content``;
#: the others by the endpoint's own name).
OPERATION = {"chat": "chat", "completions": "text_completion", "responses": "chat",
             "messages": "chat", "embeddings": "embeddings", "count_tokens": "count_tokens",
             "tokenize": "tokenize", "detokenize": "detokenize"}


class _NoSpan:
    """What :class:`Spans` gives when tracing is off: a context manager yielding the
    invalid span, whose setters do nothing (cheaper than a no-op tracer, which still
    attaches a context per span)."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN = _NoSpan()


class Spans:
    """Starts spans on ``tracer``, or nothing at all when ``tracer`` is None.

    ``spans(name, **kw)`` is ``tracer.start_as_current_span(name, **kw)`` when
    tracing is on and :data:`NO_SPAN` otherwise; ``enabled`` tells which.
    """

    def __init__(self, tracer: Tracer | None) -> None:
        self.tracer = tracer
        self.enabled = tracer is not None

    def __call__(self, name: str, **kw: Any) -> AbstractContextManager[Span]:
        if self.tracer is None:
            return NO_SPAN
        return self.tracer.start_as_current_span(name, **kw)


def make_tracer(cfg: ObservabilityConfig,
                exporter: SpanExporter | None = None) -> tuple[Spans, TracerProvider | None]:
    """Spans for the app (never the global tracer provider) and the provider to shut
    down (None when tracing is off)."""
    if not cfg.tracing or (exporter is None and not cfg.otlp_endpoint):
        return Spans(None), None
    provider = TracerProvider(resource=Resource.create({"service.name": "sluice-gateway"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    return Spans(provider.get_tracer("sluice.gateway")), provider


def inject_traceparent(headers: MutableMapping[str, str]) -> None:
    """Add ``traceparent`` (and ``tracestate``) of the current span to ``headers``."""
    PROPAGATOR.inject(headers)


def finish_span(span: Span, rec: RequestRecord) -> None:
    """Name the request's server span and set its attributes from ``rec``."""
    if not span.is_recording():
        return
    op = OPERATION.get(rec.endpoint or "")
    if op and rec.model:
        span.set_attribute("sluice.endpoint", rec.endpoint or "")
        span.update_name(f"{op} {rec.model}")
        span.set_attribute("gen_ai.operation.name", op)
        span.set_attribute("gen_ai.request.model", rec.model)
        span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", rec.completion_tokens)
        if rec.finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", rec.finish_reasons)
    span.set_attribute("http.response.status_code", rec.status)
    span.set_attribute("sluice.tenant", rec.tenant)
    span.set_attribute("sluice.outcome", rec.outcome.value)
    span.set_attribute("sluice.cache", rec.cache)
    if rec.engine:
        span.set_attribute("sluice.engine", rec.engine)
    if rec.degraded:
        span.set_attribute("sluice.degraded", list(rec.degraded))
    if rec.status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR, rec.outcome.value))
