"""The retry loop shared by a whole request's attempts and a split request's prefill
legs: each attempt holds one engine (a :class:`gateway.placement.Placement` or an
:class:`engines.pool.EngineLease`) and is retried on the next engine the attempts
yield after a retryable failure before the first byte."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

from engines.pool import Engine
from gateway.proxy import UpstreamFailed
from limits.outcome import Outcome, Rejected


class Held(Protocol):
    """An engine held for one attempt and released on ``async with`` exit."""

    @property
    def engine(self) -> Engine: ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> None: ...


H = TypeVar("H", bound=Held)
T = TypeVar("T")


async def first_success(attempts: Iterable[H], send: Callable[[H], Awaitable[T]],
                        ) -> tuple[T | None, UpstreamFailed | None]:
    """``send`` on each of ``attempts`` in turn (each released when its attempt
    ends) until one succeeds: ``(its result, None)``; or ``(None, the last failure)``
    once a failure is not retryable or the attempts run out (``(None, None)`` when
    there were none). Each engine's circuit breaker records the attempt: a success,
    or a failure on a timeout or an unreachable engine (other failures are the
    engine's answer, not its health).

    Raises:
        whatever ``send`` raises other than :class:`gateway.proxy.UpstreamFailed`.
    """
    failed: UpstreamFailed | None = None
    for held in attempts:
        async with held:
            try:
                result = await send(held)
            except UpstreamFailed as e:
                if e.outcome in (Outcome.UPSTREAM_TIMEOUT, Outcome.NO_ENGINE):
                    held.engine.breaker.record(False)
                failed = e
                if not e.retryable:
                    break
                continue
            held.engine.breaker.record(True)
            return result, None
    return None, failed


def final_error(failed: UpstreamFailed, no_engine: Rejected) -> Rejected:
    """The client's error once every attempt failed, the last with ``failed``:
    the engine's own final answer when it gave one, else a timeout, ``no_engine``
    (every engine unreachable) or a generic upstream error."""
    if failed.final is not None:
        return failed.final
    if failed.outcome is Outcome.UPSTREAM_TIMEOUT:
        return Rejected(Outcome.UPSTREAM_TIMEOUT, "The engine did not answer in time.")
    if failed.outcome is Outcome.NO_ENGINE:
        return no_engine
    return Rejected(Outcome.UPSTREAM_ERROR, "The engine failed to answer; retry shortly.")
