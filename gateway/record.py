"""One request's facts as the pipeline learns them, for metrics, access logs and the
stats feed. Created by the outermost middleware for every request (also the ones
refused before the pipeline: 401, 404, 413) and handed to observers once it ends."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.endpoints import usage_counts
from limits.degrade import DEGRADED_HEADER
from limits.outcome import Outcome

#: Label used for a tenant that could not be identified (401s, unknown paths).
UNKNOWN = "unknown"


@dataclass
class RequestRecord:
    """Times in seconds (``started`` is the app's clock,
    :class:`~limits.interfaces.Clock`, when the request arrived); ``cache`` is
    ``hit-exact``, ``hit-semantic``, ``miss`` or ``bypass``; ``degraded`` lists the
    degradation actions applied (``max_tokens=256``, ``model=small``); ``reason`` is
    the finer cause of a rejection (``requests_per_min``, ``queue_full``…);
    ``reserved_output_tokens`` is the output part of the tokens/min reservation
    (tokens; None when nothing was reserved, e.g. a cache hit); ``prefill_s`` is a
    split request's prefill leg (s, included in ``ttft_s``); ``predicted_ttft_s`` the
    adaptive admission's TTFT̂ at send time; ``endpoint`` the inference endpoint
    (:data:`gateway.openai_api.Endpoint`), None for other paths.

    Nothing a client controls is kept unbounded: ``request_id`` is the gateway's
    own; ``client_request_id`` the client's ``x-request-id``, cut and sanitised
    (:func:`gateway.middlewares.client_request_id`); ``path`` the matched route's
    template or ``unmatched`` (:func:`gateway.middlewares.route_of`); ``model`` a
    configured model the tenant may use, None until the request named one."""

    request_id: str
    client_request_id: str | None = None
    path: str = ""
    endpoint: str | None = None
    tenant: str = UNKNOWN
    priority: str = "standard"
    model: str | None = None
    engine: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    outcome: Outcome = Outcome.OK
    status: int = 200
    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reserved_output_tokens: int | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    predicted_ttft_s: float | None = None
    cache: str = "bypass"
    degraded: tuple[str, ...] = ()
    stream: bool = False
    inference: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    started: float = 0.0
    duration_s: float = 0.0

    def cache_hit(self, kind: str, usage: Mapping[str, Any], ttft_s: float) -> None:
        """Answered from the response cache (``kind``: ``exact`` or ``semantic``) with
        the cached answer's ``usage`` tokens (read as :attr:`endpoint`'s,
        :func:`gateway.endpoints.usage_counts`), ``ttft_s`` after it arrived."""
        self.cache, self.outcome = f"hit-{kind}", Outcome.CACHE_HIT
        counts = usage_counts(self.endpoint or "chat", usage)
        self.prompt_tokens, self.completion_tokens = counts[:2] if counts else (0, 0)
        self.ttft_s = ttft_s

    def headers(self) -> dict[str, str]:
        """The pipeline's response headers from this record: ``x-request-id``,
        ``x-sluice-queue-ms``, ``x-sluice-cache`` and, when any rung applied, the
        degradation actions (:data:`limits.degrade.DEGRADED_HEADER`)."""
        out = {"x-request-id": self.request_id,
               "x-sluice-queue-ms": f"{(self.queue_s or 0.0) * 1000:.1f}",
               "x-sluice-cache": self.cache}
        if self.degraded:
            out[DEGRADED_HEADER] = ", ".join(self.degraded)
        return out

    @property
    def overshoot_tokens(self) -> int:
        """Completion tokens beyond the output tokens reserved (0 when within or when
        nothing was reserved)."""
        if self.reserved_output_tokens is None:
            return 0
        return max(0, self.completion_tokens - self.reserved_output_tokens)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, s (streams only)."""
        if not self.stream or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return max(0.0, self.duration_s - self.ttft_s) / (self.completion_tokens - 1)


Observer = Callable[[RequestRecord], None]
