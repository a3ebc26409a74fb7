"""In-process :class:`~limits.interfaces.CounterStore` (``memory://``): the embedded
default for one gateway process, and the local fallback while Redis is unreachable.

Rate limits use the Generic Cell Rate Algorithm (GCRA), the virtual-scheduling form
of the leaky bucket from the ATM Forum Traffic Management Specification 4.0 (1996),
as popularised for API rate limiting by Brandur Leach ("Rate Limiting, Cells, and
GCRA", 2015). Per key it stores one number, the theoretical arrival time (TAT):

* emission interval ``T = 1 / rate_per_s`` seconds per unit, tolerance
  ``tau = burst × T`` seconds;
* a take of ``cost`` units computes ``new_tat = max(tat, now) + cost × T`` and is
  allowed iff ``new_tat − now ≤ tau``; otherwise it may retry after
  ``new_tat − tau − now`` seconds;
* so a full bucket admits exactly ``burst`` units at once, then ``rate_per_s`` units
  per second.

:file:`limits/redis_store.py` runs the same arithmetic in Lua.
"""

from __future__ import annotations

from collections.abc import Sequence

from limits.interfaces import Bucket, Clock, TakeResult

#: Slack for floating-point sums of emission intervals, s.
EPSILON_S = 1e-6


def gcra_take(tat: float | None, now: float, bucket: Bucket) -> tuple[float, float]:
    """One GCRA step: ``(new_tat, wait_s)``; the take fits iff ``wait_s ≤ EPSILON_S``.

    Args:
        tat: stored theoretical arrival time, s (None: never used or expired).
        now: current time, s, on the same clock as ``tat``.
        bucket: cost (units), rate (units/s) and burst (units).
    """
    interval = 1.0 / bucket.rate_per_s
    new_tat = max(tat if tat is not None else now, now) + bucket.cost * interval
    return new_tat, new_tat - bucket.burst * interval - now


class MemoryStore:
    """GCRA buckets and expiring leases in dicts; every method completes without
    awaiting, so each is atomic on the event loop.

    Args:
        clock: time source for TATs and lease expiry (injected for tests).
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.failovers = 0  # nothing to fail over from
        self.pending_releases = 0  # every release lands at once
        self._tats: dict[str, float] = {}
        self._leases: dict[str, dict[str, float]] = {}

    async def take(self, buckets: Sequence[Bucket]) -> TakeResult:
        now = self._clock.now()
        steps = [gcra_take(self._tats.get(b.key), now, b) for b in buckets]
        waits = [wait for _, wait in steps]
        if waits and max(waits) > EPSILON_S:
            worst = max(range(len(waits)), key=waits.__getitem__)
            return TakeResult(False, waits[worst], worst)
        for bucket, (new_tat, _) in zip(buckets, steps, strict=True):
            self._store(bucket.key, new_tat, now)
        return TakeResult(True)

    async def adjust(self, bucket: Bucket) -> None:
        now = self._clock.now()
        new_tat, _ = gcra_take(self._tats.get(bucket.key), now, bucket)
        self._store(bucket.key, max(new_tat, now), now)

    def _store(self, key: str, tat: float, now: float) -> None:
        if tat > now:
            self._tats[key] = tat
        else:  # a full bucket needs no state
            self._tats.pop(key, None)

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        now = self._clock.now()
        leases = {i: exp for i, exp in self._leases.get(key, {}).items() if exp > now}
        granted = lease_id in leases or len(leases) < limit
        if granted:
            leases[lease_id] = now + ttl_s
        if leases:
            self._leases[key] = leases
        else:
            self._leases.pop(key, None)
        return granted

    async def release(self, key: str, lease_id: str) -> None:
        leases = self._leases.get(key)
        if leases is not None:
            leases.pop(lease_id, None)
            if not leases:
                del self._leases[key]

    async def close(self) -> None:
        self._tats.clear()
        self._leases.clear()
