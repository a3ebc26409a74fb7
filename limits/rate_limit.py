"""Per-tenant requests/min, tokens/min and concurrency, reserved before a request is
forwarded and settled with the real usage afterwards.

Requests and tokens per minute are GCRA buckets (ATM Forum TM 4.0; Brandur Leach,
"Rate Limiting, Cells, and GCRA", 2015) in a :class:`~limits.interfaces.CounterStore`:
capacity one minute's limit, refilled continuously at limit/60 per second, so a
tenant idle for a minute may burst its whole limit at once and then proceeds at the
sustained rate. Both buckets are taken in one all-or-nothing store call. Concurrency
is an expiring lease (``lease_ttl_s``, renewed every ``lease_ttl_s / 2`` while held),
so a crashed replica's slots come back by themselves.

Tokens are reserved up front as ``prompt estimate + max output tokens``; only
admitted reservations count, so concurrent and streamed requests cannot overshoot a
tokens/min budget — except by what one request's actual usage exceeds its own
reservation (charged on settle as debt that delays the tenant's next requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from types import TracebackType

from config.schema import TenantQuota
from limits.interfaces import Bucket, CounterStore, StoreUnavailable
from limits.outcome import Outcome, Rejected

#: Retry-After for a full concurrency limit: a slot frees whenever a request ends, s.
CONCURRENCY_RETRY_S = 1.0


class Reservation:
    """What :meth:`RateLimiter.reserve` took for one request; an async context manager.

    Attributes:
        tenant: tenant name.
        tokens: tokens reserved (prompt estimate + max output), tokens.
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
    ) -> None:
        self.tenant = tenant
        self.tokens = tokens
        self.settled = False
        self.released = lease is None
        self._store = store
        self._token_bucket = token_bucket
        self._lease = lease
        self._renewal: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        if lease is not None:
            self._schedule_renewal()

    async def settle(self, actual_tokens: int) -> None:
        """Correct the tokens/min budget by ``actual_tokens − tokens`` (refund when
        the request used less than reserved, charge extra when more). Only the
        first call counts; later calls do nothing. Never raises on store outages."""
        if self.settled:
            return
        self.settled = True
        delta = actual_tokens - self.tokens
        if self._token_bucket is not None and delta:
            b = self._token_bucket
            await self._store.adjust(Bucket(b.key, delta, b.rate_per_s, b.burst))

    async def release(self) -> None:
        """Return the concurrency slot; idempotent, never raises on store outages."""
        if self.released or self._lease is None:
            return
        self.released = True
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
                ``Outcome.OVERLOADED`` (reason ``"store_unavailable"``) when the
                store fails closed. Nothing stays taken when it raises.
        """
        base = f"{self._prefix}:{{{tenant.name}}}"
        tpm = tenant.tokens_per_min
        if tpm is not None and tokens > tpm:
            raise Rejected(
                Outcome.RATE_LIMITED,
                f"this request reserves {tokens} tokens (prompt + max output), more than "
                f"tenant {tenant.name}'s limit of {tpm} tokens per minute; lower max_tokens",
                retry_after_s=60.0,
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
        checks: list[tuple[Bucket, str, str]] = []  # bucket, reason, unit
        if tenant.requests_per_min is not None:
            rpm = tenant.requests_per_min
            checks.append((Bucket(f"{base}:rpm", 1, rpm / 60, rpm), "requests_per_min",
                           "requests"))
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
        return Reservation(self._store, tenant.name, tokens, token_bucket, lease)
