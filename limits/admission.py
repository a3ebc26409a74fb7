"""Bounded admission queue per model: priority bands, weighted fair share between
tenants inside a band, deadlines, shedding, and ``Retry-After`` from the drain rate.

Order: strict priority between bands (:data:`config.schema.PRIORITIES`, most urgent
first); inside a band, deficit round robin on estimated tokens between tenants,
weighted by ``TenantQuota.weight`` (:mod:`limits.drr`; Shreedhar & Varghese 1995), and
each tenant's tickets earliest deadline first (EDF; Liu & Layland, JACM 1973), so a
request with a short ``x-request-timeout`` goes before its tenant's longer-waiting ones.
Placement is tried in that order only: when the next ticket does not fit, later ones
wait too (no backfilling, which would starve large or urgent requests).

Bounds (:class:`config.schema.QueueConfig`): ``max_requests`` tickets and
``max_tokens`` estimated tokens. A ticket that does not fit sheds the lowest-priority
newest queued ticket — possibly itself — with ``Rejected(OVERLOADED,
reason="queue_full")``. A ticket predicted to miss its deadline — the tickets ahead
of it (its band and more urgent ones) over the drain rate exceed the time it has
left — is shed at once with ``Rejected(OVERLOADED, reason="predicted_miss")``
rather than waiting to be served late (a request that misses its SLO only wastes
capacity). ``Retry-After`` is the predicted drain time, ``ceil(backlog / drain
rate)`` seconds, at least 1, where the drain rate is an EWMA of admissions per
second (:mod:`limits.drain_rate`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from config.schema import PRIORITIES, Priority, QueueConfig, TenantQuota
from limits.drain_rate import DrainRate, ServiceRate
from limits.drr import DeficitRoundRobin
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected

P = TypeVar("P")


@dataclass(eq=False)
class Ticket:
    """One request waiting for admission.

    Attributes:
        tenant: tenant name (the fair-share flow).
        priority: band, one of :data:`~config.schema.PRIORITIES`.
        tokens: estimated prompt + max output tokens.
        deadline: clock time after which it leaves with ``queue_timeout``, s.
        weight: the tenant's fair-share weight (> 0).
        request_id: for logs.
        queue_wait_s: time from :meth:`AdmissionQueue.admit` to placement, s (set on
            admission; 0 on the fast path).
    """

    tenant: str
    priority: Priority
    tokens: int
    deadline: float
    weight: float = 1.0
    request_id: str = ""
    queue_wait_s: float = 0.0


@dataclass(eq=False)
class _Waiter(Generic[P]):
    ticket: Ticket
    band: int
    place: Callable[[Ticket], P | None]
    undo: Callable[[P], None]
    future: asyncio.Future[P]
    enqueued_at: float


class AdmissionQueue(Generic[P]):
    """The queue in front of one model's engines.

    Args:
        model: served model name (for messages).
        config: bounds and default wait.
        clock: time source (monotonic s, the event loop's clock in production).
        retry_interval_s: placement is retried this often while tickets wait, even
            without :meth:`kick` (default 0.1 s).
        quantum_tokens: DRR quantum for weight 1, tokens (default
            ``QueueConfig.quantum_tokens``, 1024: a weight-1 tenant's turn lasts a few
            typical requests, so fair share holds over seconds, not minutes).
        drain_tau_s: time constant of the drain-rate EWMA, s (default 10).
        max_retry_after_s: cap of suggested ``Retry-After``, s (default 60).
    """

    def __init__(
        self,
        model: str,
        config: QueueConfig,
        clock: Clock,
        *,
        retry_interval_s: float = 0.1,
        quantum_tokens: int | None = None,
        drain_tau_s: float = 10.0,
        max_retry_after_s: float = 60.0,
    ) -> None:
        self.model = model
        self.config = config
        self._clock = clock
        self._retry_interval_s = retry_interval_s
        self._max_retry_after_s = max_retry_after_s
        self._bands: list[DeficitRoundRobin[_Waiter[P]]] = [
            DeficitRoundRobin(quantum_tokens or config.quantum_tokens) for _ in PRIORITIES]
        # per band, queued waiters in arrival order (dicts keep insertion order)
        self._arrivals: list[dict[_Waiter[P], None]] = [{} for _ in PRIORITIES]
        self._tokens = 0
        self._drain = DrainRate(drain_tau_s)
        self._service = ServiceRate()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ public

    def ticket(self, tenant: TenantQuota, tokens: int, *, request_id: str = "",
               timeout_s: float | None = None) -> Ticket:
        """A ticket for ``tenant`` whose deadline is now + the tenant's
        ``max_queue_wait_s`` (else ``QueueConfig.default_max_wait_s``), tightened to
        ``timeout_s`` (the client's ``x-request-timeout``, s) when that is shorter."""
        wait_s = tenant.max_queue_wait_s or self.config.default_max_wait_s
        if timeout_s is not None:
            wait_s = min(wait_s, timeout_s)
        return Ticket(tenant.name, tenant.priority, tokens, self._clock.now() + wait_s,
                      tenant.weight, request_id)

    async def admit(self, ticket: Ticket, place: Callable[[Ticket], P | None],
                    undo: Callable[[P], None]) -> P:
        """Wait until ``place(ticket)`` returns a placement, in fair order.

        Args:
            ticket: the request (see :meth:`ticket`).
            place: synchronous, non-blocking; reserves capacity (e.g. an engine lease)
                and returns it, or returns None when nothing fits now. Exceptions it
                raises end this ticket's wait with that exception.
            undo: hands back a placement made for a waiter that was cancelled before
                it could take it (the client went away at that instant).

        Returns the placement at once, without a task switch, when the queue is
        empty and ``place`` succeeds.

        Raises:
            Rejected: ``QUEUE_TIMEOUT`` at the deadline; ``OVERLOADED`` with reason
                ``queue_full`` when shed, ``predicted_miss`` when the queue ahead
                predicts a wait past the deadline. All carry ``retry_after_s``
                (integer ≥ 1).
            asyncio.CancelledError: when the caller is cancelled; the ticket leaves
                the queue at once.
        """
        now = self._clock.now()
        if len(self) == 0:
            placement = place(ticket)
            if placement is not None:
                self._drain.add(now)
                return placement
        if ticket.deadline <= now:
            raise self._timeout(ticket, 0.0)
        if self._service.rate() is not None and \
                self.predicted_wait_s(ticket.priority) > ticket.deadline - now:
            raise self._shed(ticket, predicted=True)
        self._loop = asyncio.get_running_loop()
        waiter = _Waiter(ticket, PRIORITIES.index(ticket.priority), place, undo,
                         self._loop.create_future(), now)
        self._make_room(waiter)
        self._push(waiter)
        self._dispatch()
        try:
            async with asyncio.timeout(ticket.deadline - now):
                return await waiter.future
        except TimeoutError:
            self._discard(waiter)
            if _has_result(waiter.future):
                return waiter.future.result()  # placed just as the deadline passed
            raise self._timeout(ticket, self._clock.now() - now) from None
        except asyncio.CancelledError:
            self._discard(waiter)
            if _has_result(waiter.future):
                undo(waiter.future.result())
            raise

    def kick(self) -> None:
        """Retry placement soon (coalesced; runs on the next loop iteration). Call it
        whenever capacity may have changed: lease released, metrics, engine state."""
        if self._loop is not None and self._kick is None and len(self):
            self._kick = self._loop.call_soon(self._dispatch)

    def __len__(self) -> int:
        return sum(len(a) for a in self._arrivals)

    def depth(self) -> dict[Priority, int]:
        """Tickets waiting per priority band."""
        return {p: len(a) for p, a in zip(PRIORITIES, self._arrivals, strict=True)}

    @property
    def tokens_queued(self) -> int:
        """Estimated tokens of the waiting tickets."""
        return self._tokens

    def predicted_wait_s(self, priority: Priority | None = None) -> float:
        """Seconds a new ticket would wait: the tickets ahead of it plus itself over
        the rate at which a backlog drains (:class:`~limits.drain_rate.ServiceRate`,
        placements/s while tickets wait), or before a backlog was seen, the observed
        admission rate; before anything drained, ``QueueConfig.default_max_wait_s``.
        With ``priority``, only tickets of that band and more urgent ones count
        (strict priority: less urgent bands wait behind it); without, the whole
        backlog."""
        ahead = len(self) if priority is None else sum(
            len(a) for a in self._arrivals[:PRIORITIES.index(priority) + 1])
        rate = self._service.rate() or self._drain.rate(self._clock.now())
        return (ahead + 1) / rate if rate > 0 else self.config.default_max_wait_s

    def retry_after_s(self) -> int:
        """Suggested ``Retry-After``: :meth:`predicted_wait_s` for the whole backlog,
        rounded up, at least 1, at most ``max_retry_after_s``."""
        return max(1, math.ceil(min(self.predicted_wait_s(), self._max_retry_after_s)))

    def close(self, error: Callable[[], Rejected] | None = None) -> None:
        """Reject every waiting ticket with a fresh ``error()`` (default
        ``OVERLOADED``, reason ``shutdown``) and stop the retry timer."""
        for band in self._arrivals:
            for waiter in list(band):
                self._discard(waiter)
                self._fail(waiter, error() if error else Rejected(
                    Outcome.OVERLOADED, "the gateway is shutting down", retry_after_s=1.0,
                    reason="shutdown"))
        for handle in (self._kick, self._timer):
            if handle is not None:
                handle.cancel()
        self._kick = self._timer = None

    # ------------------------------------------------------------------ internals

    def _dispatch(self) -> None:
        """Place waiters in fair order until one does not fit."""
        self._kick = None
        while (waiter := self._next()) is not None:
            if waiter.future.done():  # cancelled; its task has not run its cleanup yet
                self._discard(waiter)
                continue
            try:
                placement = waiter.place(waiter.ticket)
            except Exception as e:  # noqa: BLE001 - it is that request's error
                self._discard(waiter)
                waiter.future.set_exception(e)
                continue
            if placement is None:
                break
            self._discard(waiter, served=True)
            now = self._clock.now()
            waiter.ticket.queue_wait_s = now - waiter.enqueued_at
            self._drain.add(now)
            self._service.departed(now, backlog_left=len(self) > 0)
            waiter.future.set_result(placement)
        self._arm_timer()

    def _next(self) -> _Waiter[P] | None:
        for band in self._bands:
            waiter = band.head()
            if waiter is not None:
                return waiter
        return None

    def _arm_timer(self) -> None:
        if len(self) and self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(self._retry_interval_s, self._on_timer)
        elif not len(self) and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _make_room(self, incoming: _Waiter[P]) -> None:
        """Shed lowest-priority newest tickets until ``incoming`` fits the bounds;
        raise for ``incoming`` itself when it is the one to go."""
        cfg = self.config
        while (len(self) + 1 > cfg.max_requests
               or self._tokens + incoming.ticket.tokens > cfg.max_tokens):
            victim = self._lowest_newest()
            if victim is None or victim.band <= incoming.band:
                raise self._shed(incoming.ticket)
            self._discard(victim)
            self._fail(victim, self._shed(victim.ticket))

    def _lowest_newest(self) -> _Waiter[P] | None:
        for arrivals in reversed(self._arrivals):
            if arrivals:
                return next(reversed(arrivals))
        return None

    def _push(self, waiter: _Waiter[P]) -> None:
        t = waiter.ticket
        self._bands[waiter.band].push(t.tenant, waiter, t.tokens, t.weight, key=t.deadline)
        self._arrivals[waiter.band][waiter] = None
        self._tokens += t.tokens
        self._service.backlogged(self._clock.now())

    def _discard(self, waiter: _Waiter[P], *, served: bool = False) -> None:
        """Remove ``waiter`` from the queue if it is still there; ``served`` (it is
        the band's DRR head and was placed) charges its tokens to its tenant."""
        arrivals = self._arrivals[waiter.band]
        if waiter in arrivals:
            del arrivals[waiter]
            band = self._bands[waiter.band]
            if served:
                band.pop()
            else:
                band.remove(waiter.ticket.tenant, waiter)
            self._tokens -= waiter.ticket.tokens
            if not served and not len(self):
                self._service.idle()
        self._arm_timer()

    @staticmethod
    def _fail(waiter: _Waiter[P], error: Rejected) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _shed(self, ticket: Ticket, *, predicted: bool = False) -> Rejected:
        if predicted:
            return Rejected(
                Outcome.OVERLOADED,
                f"the {self.model} queue would not reach this {ticket.priority} request "
                "before its deadline; shed",
                retry_after_s=self.retry_after_s(), reason="predicted_miss")
        return Rejected(
            Outcome.OVERLOADED,
            f"the {self.model} queue is full; {ticket.priority} request shed",
            retry_after_s=self.retry_after_s(),
            reason="queue_full",
        )

    def _timeout(self, ticket: Ticket, waited_s: float) -> Rejected:
        return Rejected(
            Outcome.QUEUE_TIMEOUT,
            f"no {self.model} capacity within the request's queue deadline "
            f"(waited {waited_s:.1f} s)",
            retry_after_s=self.retry_after_s(),
            reason="queue_timeout",
        )


def _has_result(future: asyncio.Future[P]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
