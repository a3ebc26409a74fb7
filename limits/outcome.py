"""Every way a request can end, mapped in this one place to an HTTP status, an
OpenAI error ``type`` and an OpenAI error ``code``.

OpenAI's error body is ``{"error": {"message", "type", "param", "code"}}``
(https://platform.openai.com/docs/guides/error-codes). Outcomes whose status is 429
or 503 always carry an integer ``Retry-After`` header (RFC 9110 §10.2.3). A 503 is
the service refusing the request itself, so its rate-limit charge is refunded
(:attr:`Outcome.refunded`).
"""

from __future__ import annotations

from enum import Enum


class Outcome(Enum):
    """``value`` is the stable name used in metrics and logs."""

    OK = "ok"
    CACHE_HIT = "cache_hit"
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BODY_TOO_LARGE = "body_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    RATE_LIMITED = "rate_limited"
    EXCEEDS_QUOTA = "exceeds_quota"
    OVERLOADED = "overloaded"
    QUEUE_TIMEOUT = "queue_timeout"
    NO_ENGINE = "no_engine"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    CLIENT_DISCONNECTED = "client_disconnected"
    INTERNAL_ERROR = "internal_error"

    @property
    def status(self) -> int:
        return _HTTP[self][0]

    @property
    def error_type(self) -> str | None:
        return _HTTP[self][1]

    @property
    def code(self) -> str | None:
        return _HTTP[self][2]

    @property
    def needs_retry_after(self) -> bool:
        return self.status in (429, 503)

    @property
    def refunded(self) -> bool:
        """The service refused the request itself (every 503: shed or overloaded,
        queue timeout, no engine), so the client did nothing wrong and gets back the
        request and tokens its tenant was charged (``Reservation.refund``)."""
        return self.status == 503


# outcome -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP: dict[Outcome, tuple[int, str | None, str | None]] = {
    Outcome.OK: (200, None, None),
    Outcome.CACHE_HIT: (200, None, None),
    Outcome.INVALID_REQUEST: (400, "invalid_request_error", "invalid_request"),
    Outcome.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length_exceeded"),
    Outcome.UNAUTHORIZED: (401, "authentication_error", "invalid_api_key"),
    Outcome.FORBIDDEN: (403, "permission_error", "forbidden"),
    Outcome.MODEL_NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    Outcome.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    Outcome.METHOD_NOT_ALLOWED: (405, "invalid_request_error", "method_not_allowed"),
    Outcome.BODY_TOO_LARGE: (413, "invalid_request_error", "request_too_large"),
    Outcome.REQUEST_TIMEOUT: (408, "invalid_request_error", "request_timeout"),
    Outcome.RATE_LIMITED: (429, "rate_limit_error", "rate_limit_exceeded"),
    # a request larger than its tenant's whole tokens/min budget: retrying cannot help,
    # so no 429 and no Retry-After
    Outcome.EXCEEDS_QUOTA: (400, "invalid_request_error", "request_exceeds_quota"),
    Outcome.OVERLOADED: (503, "server_error", "overloaded"),
    Outcome.QUEUE_TIMEOUT: (503, "server_error", "queue_timeout"),
    Outcome.NO_ENGINE: (503, "server_error", "engine_unavailable"),
    Outcome.UPSTREAM_ERROR: (502, "server_error", "upstream_error"),
    Outcome.UPSTREAM_TIMEOUT: (504, "server_error", "upstream_timeout"),
    Outcome.CLIENT_DISCONNECTED: (499, None, "client_disconnected"),
    Outcome.INTERNAL_ERROR: (500, "server_error", "internal_error"),
}


class Rejected(Exception):
    """Raised by admission steps (rate limit, queue, shedding, auth, validation) to end
    a request with an error outcome.

    Attributes:
        outcome: the :class:`Outcome`.
        message: user-facing text (never a key, a prompt or a stack trace).
        param: the request field at fault, or None.
        retry_after_s: seconds the client should wait (rounded up to an integer on the
            wire; at least 1 for 429/503).
        reason: finer label for metrics, e.g. ``tokens_per_min``.
    """

    def __init__(
        self,
        outcome: Outcome,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.reason = reason or outcome.value
