"""Per-tenant requests/min, tokens/min and concurrency, reserved before a request is
forwarded and settled with the real usage afterwards.

Requests and tokens per minute are GCRA buckets (ATM Forum TM 4.0; Brandur Leach,
"Rate Limiting, Cells, and GCRA", 2015) in a :class:`~limits.interfaces.CounterStore`:
capacity one minute's limit, refilled continuously at limit/60 per second, so a
tenant idle for a minute may burst its whole limit at once and then proceeds at the
sustained rate. Both buckets are taken in one all-or-nothing store call. Concurrency
is an expiring lease (``lease_ttl_s``, renewed every ``lease_ttl_s / 2`` while held),
so a crashed replica's slots come back by themselves.

Tokens are reserved up front as ``prompt + max output tokens × sequences``
(:func:`reservation_size`); only
admitted reservations count, so concurrent and streamed requests cannot overshoot a
tokens/min budget — except by what one request's actual usage exceeds its own
reservation (charged on settle as debt that delays the tenant's next requests). A request the
service refused itself (a 503: shed, queue timeout, no engine) is refunded its
request and tokens (:meth:`Reservation.refund`): the client did nothing wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from types import TracebackType

from config.schema import TenantQuota
from limits.interfaces import Bucket, CounterStore, StoreUnavailable
from limits.outcome import Outcome, Rejected

#: Retry-After for a full concurrency limit: a slot frees whenever a request ends, s.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class Sizing:
    """Tokens one request reserves.

    Attributes:
        prompt: prompt tokens (all prompts), tokens.
        output: output tokens reserved (per-sequence cap × sequences), tokens.
    """

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def reservation_size(
    tenant: TenantQuota,
    *,
    prompt_tokens: int,
    output_cap: int | None,
    sequences: int,
    default_output_tokens: int,
    output_param: str,
    prompt_param: str,
) -> Sizing:
    """What to reserve for a request: ``prompt_tokens + cap × sequences``.

    Without a cap (``output_cap`` None) the cap reserved per sequence is
    ``default_output_tokens``, lowered to what the tenant's tokens/min budget can
    ever hold beside the prompt, ``(tokens_per_min − prompt) // sequences``: a
    default must not make a request that fits impossible (its real usage is settled
    afterwards, see :meth:`Reservation.settle`).

    Args:
        prompt_tokens / output_cap / sequences: the request's need, tokens and count.
        default_output_tokens: ``gateway.default_output_tokens``.
        output_param / prompt_param: request fields named in the error.

    Raises:
        Rejected: ``Outcome.EXCEEDS_QUOTA`` (400, no ``Retry-After``) when even the
            smallest reservation (the explicit cap, or one output token per sequence)
            exceeds the budget: the request can never be admitted.
    """
    tpm = tenant.tokens_per_min
    if output_cap is not None:
        size = Sizing(prompt_tokens, output_cap * sequences)
        if tpm is not None and size.total > tpm:
            raise Rejected(
                Outcome.EXCEEDS_QUOTA,
                f"this request needs {size.total} tokens ({prompt_tokens} prompt + "
                f"{output_cap} × {sequences} output), more than tenant {tenant.name}'s whole "
                f"budget of {tpm} tokens per minute; lower '{output_param}'",
                param=output_param, reason="tokens_per_min")
        return size
    per_sequence = default_output_tokens
    if tpm is not None:
        per_sequence = min(per_sequence, (tpm - prompt_tokens) // sequences)
        if per_sequence < 1:
            raise Rejected(
                Outcome.EXCEEDS_QUOTA,
                f"this request's prompt is {prompt_tokens} tokens; with {sequences} output "
                f"sequences it cannot fit tenant {tenant.name}'s whole budget of {tpm} tokens "
                "per minute",
                param=prompt_param, reason="tokens_per_min")
    return Sizing(prompt_tokens, per_sequence * sequences)


class Reservation:
    """What :meth:`RateLimiter.reserve` took for one request; an async context manager.

    Attributes:
        tenant: tenant name.
        tokens: tokens reserved (see :func:`reservation_size`), tokens.
        settled: whether :meth:`settle` ran (only the first call counts).
        released: whether the concurrency slot (if any) was returned.
    """

    def __init__(
        self,
        store: CounterStore,
        tenant: str,
        tokens: int,
        token_bucket: Bucket | None,
        lease: tuple[str, str, int, float] | None,
        open_: set[Reservation] | None = None,
        request_bucket: Bucket | None = None,
    ) -> None:
        self.tenant = tenant
        self.tokens = tokens
        self.settled = False
        self.released = lease is None
        self._store = store
        self._token_bucket = token_bucket
        self._request_bucket = request_bucket
        self._lease = lease
        self._renewal: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._open = open_ if open_ is not None else set()
        self._open.add(self)
        if lease is not None:
            self._schedule_renewal()

    def _closed(self) -> None:
        if self.settled and self.released:
            self._open.discard(self)

    async def settle(self, actual_tokens: int) -> None:
        """Correct the tokens/min budget by ``actual_tokens − tokens`` (refund when
        the request used less than reserved, charge extra when more). Only the
        first call counts; later calls do nothing. Never raises on store outages."""
        if self.settled:
            return
        self.settled = True
        self._closed()
        delta = actual_tokens - self.tokens
        if self._token_bucket is not None and delta:
            b = self._token_bucket
            await self._store.adjust(Bucket(b.key, delta, b.rate_per_s, b.burst))

    async def refund(self) -> None:
        """Give back the request (requests/min) and every reserved token: the
        service refused the request itself (:attr:`Outcome.refunded`). Only if
        nothing settled yet; then :meth:`settle` does nothing. Never raises on store
        outages."""
        if self.settled:
            return
        if self._request_bucket is not None:
            b = self._request_bucket
            await self._store.adjust(Bucket(b.key, -b.cost, b.rate_per_s, b.burst))
        await self.settle(0)

    async def release(self) -> None:
        """Return the concurrency slot; idempotent, never raises on store outages."""
        if self.released or self._lease is None:
            return
        self.released = True
        self._closed()
        if self._renewal is not None:
            self._renewal.cancel()
        if self._renewing is not None:  # let an in-flight renewal land before removing
            await asyncio.gather(self._renewing, return_exceptions=True)
        key, lease_id, _, _ = self._lease
        await self._store.release(key, lease_id)

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release the slot; settle with the reserved amount if nothing settled."""
        try:
            await self.settle(self.tokens)
        finally:
            await self.release()

    def _schedule_renewal(self) -> None:
        assert self._lease is not None
        ttl_s = self._lease[3]
        self._renewal = asyncio.get_running_loop().call_later(ttl_s / 2, self._renew)

    def _renew(self) -> None:
        self._renewing = asyncio.get_running_loop().create_task(self._renew_once())
        self._schedule_renewal()

    async def _renew_once(self) -> None:
        assert self._lease is not None
        # store down: the lease expires there and is released locally anyway
        with contextlib.suppress(Rejected, StoreUnavailable):
            await self._store.acquire(*self._lease)


class RateLimiter:
    """Checks a tenant's requests/min (cost 1), tokens/min (cost = reserved tokens)
    and max concurrent requests; ``None`` limits are not checked.

    Args:
        store: shared counter store (see :func:`limits.stores.open_store`).
        lease_ttl_s: concurrency lease expiry, s (``LimitsConfig.lease_ttl_s``,
            default 600); held leases are renewed every ``lease_ttl_s / 2``.
        prefix: key prefix in the store.

    Keys are ``{prefix}:{{tenant}}:rpm|tpm|concurrent``; the braces are a Redis
    Cluster hash tag, keeping one tenant's keys on one shard.
    """

    def __init__(self, store: CounterStore, *, lease_ttl_s: float = 600.0,
                 prefix: str = "sluice") -> None:
        self._store = store
        self._lease_ttl_s = lease_ttl_s
        self._prefix = prefix
        self._open: set[Reservation] = set()

    @property
    def open_reservations(self) -> int:
        """Reservations this process took and has not both settled and released."""
        return len(self._open)

    @property
    def held_slots(self) -> int:
        """Concurrency slots this process holds and has not released."""
        return sum(1 for r in self._open if not r.released)

    async def reserve(
        self,
        tenant: TenantQuota,
        tokens: int,
        *,
        request_id: str,
        concurrency: bool = True,
    ) -> Reservation:
        """Reserve one request, ``tokens`` tokens and (if ``concurrency``) one
        concurrency slot for ``tenant``; all or nothing.

        A cache hit calls ``reserve(tenant, 0, request_id=…, concurrency=False)``:
        one request, no tokens, no slot.

        Raises:
            Rejected: ``Outcome.RATE_LIMITED`` with ``reason`` ``"requests_per_min"``,
                ``"tokens_per_min"`` or ``"concurrency"`` and ``retry_after_s``;
                ``Outcome.EXCEEDS_QUOTA`` (no retry) when ``tokens`` exceeds the whole
                tokens/min budget (see :func:`reservation_size`);
                ``Outcome.OVERLOADED`` (reason ``"store_unavailable"``) when the
                store fails closed. Nothing stays taken when it raises.
        """
        base = f"{self._prefix}:{{{tenant.name}}}"
        tpm = tenant.tokens_per_min
        if tpm is not None and tokens > tpm:
            raise Rejected(
                Outcome.EXCEEDS_QUOTA,
                f"this request reserves {tokens} tokens, more than tenant {tenant.name}'s "
                f"whole budget of {tpm} tokens per minute; it can never be admitted",
                reason="tokens_per_min",
            )
        lease = None
        if concurrency and tenant.max_concurrent is not None:
            lease = (f"{base}:concurrent", f"{request_id}:{uuid.uuid4().hex[:12]}",
                     tenant.max_concurrent, self._lease_ttl_s)
            if not await self._store.acquire(*lease):
                raise Rejected(
                    Outcome.RATE_LIMITED,
                    f"tenant {tenant.name} already has {tenant.max_concurrent} concurrent "
                    "requests in flight, its limit",
                    retry_after_s=CONCURRENCY_RETRY_S,
                    reason="concurrency",
                )
        token_bucket = None if tpm is None else Bucket(f"{base}:tpm", tokens, tpm / 60, tpm)
        rpm = tenant.requests_per_min
        request_bucket = None if rpm is None else Bucket(f"{base}:rpm", 1, rpm / 60, rpm)
        checks: list[tuple[Bucket, str, str]] = []  # bucket, reason, unit
        if request_bucket is not None:
            checks.append((request_bucket, "requests_per_min", "requests"))
        if token_bucket is not None and tokens > 0:
            checks.append((token_bucket, "tokens_per_min", "tokens"))
        try:
            result = await self._store.take([b for b, _, _ in checks])
        except BaseException:
            if lease is not None:
                await self._store.release(lease[0], lease[1])
            raise
        if not result.allowed:
            if lease is not None:
                await self._store.release(lease[0], lease[1])
            assert result.denied is not None
            bucket, reason, unit = checks[result.denied]
            raise Rejected(
                Outcome.RATE_LIMITED,
                f"tenant {tenant.name} exceeded its limit of {bucket.burst:.0f} {unit} per "
                "minute",
                retry_after_s=result.retry_after_s,
                reason=reason,
            )
        return Reservation(self._store, tenant.name, tokens, token_bucket, lease, self._open,
                           request_bucket)
