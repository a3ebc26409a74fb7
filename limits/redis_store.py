"""Redis :class:`~limits.interfaces.CounterStore` (``redis://``), shared by every
gateway replica.

Each operation is one atomic Lua script (registered once per store; redis-py reloads
it after ``NOSCRIPT``). Time comes from the Redis server (``TIME`` inside the
script), never from the replicas, so replicas with skewed clocks still agree on
every bucket and lease; Redis ≥ 5 replicates script effects, which makes ``TIME``
safe before writes.

* Buckets: the GCRA of :mod:`limits.memory_store` (ATM Forum TM 4.0; Brandur Leach,
  2015), one string key per bucket holding the TAT (s, ``%.17g`` so it round-trips
  exactly), expiring when the bucket would be full again.
* Leases: a sorted set per key, member = lease id, score = expiry time (s); expired
  members are removed before counting, so a crashed replica's slots come back after
  ``ttl_s`` at most. The key itself expires with its last lease.

Outages raise :class:`~limits.interfaces.StoreUnavailable`: connection refused,
socket timeout, and a Redis that answers but refuses the work (:func:`refuses_work`:
a read-only replica after a failover ``READONLY``, ``maxmemory`` with ``noeviction``
``OOM``, a failed snapshot ``MISCONF``, ``LOADING``, ``BUSY``, ``MASTERDOWN``,
``NOREPLICAS``, ACL/auth refusals, …). Any other ``ResponseError`` (a script bug)
propagates. Sockets time out after ``timeout_s`` so a dead Redis never holds a
request for long.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limits.interfaces import Bucket, StoreUnavailable, TakeResult
from limits.memory_store import EPSILON_S

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: bucket keys. ARGV: cost, rate_per_s, burst for each key, then epsilon.
# Returns {1} or {0, wait_s (string), index of the longest wait (0-based)}.
_TAKE = _NOW + """
local n = #KEYS
local eps = tonumber(ARGV[3 * n + 1])
local new, worst, worst_i = {}, eps, -1
for i = 1, n do
  local interval = 1 / tonumber(ARGV[3 * i - 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  new[i] = tat + tonumber(ARGV[3 * i - 2]) * interval
  local wait = new[i] - tonumber(ARGV[3 * i]) * interval - now
  if wait > worst then worst, worst_i = wait, i - 1 end
end
if worst_i >= 0 then return {0, string.format('%.17g', worst), worst_i} end
for i = 1, n do
  if new[i] > now then
    local ms = math.ceil((new[i] - now) * 1000)
    redis.call('SET', KEYS[i], string.format('%.17g', new[i]), 'PX', ms)
  end
end
return {1}
"""

# KEYS[1]: bucket key. ARGV: cost (negative refunds), rate_per_s.
_ADJUST = _NOW + """
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
tat = tat + tonumber(ARGV[1]) / tonumber(ARGV[2])
if tat > now then
  local ms = math.ceil((tat - now) * 1000)
  redis.call('SET', KEYS[1], string.format('%.17g', tat), 'PX', ms)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

# KEYS[1]: lease set. ARGV: lease id, limit, ttl_s. Returns 1 if granted.
_ACQUIRE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now))
if not redis.call('ZSCORE', KEYS[1], ARGV[1])
   and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], string.format('%.17g', now + tonumber(ARGV[3])), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) * 1000))
return 1
"""

_OUTAGES = (RedisConnectionError, RedisTimeoutError, OSError)
#: Error replies redis-py maps to their own classes that mean the server refuses work.
_REFUSALS = (ReadOnlyError, OutOfMemoryError, MasterDownError, ClusterDownError,
             TryAgainError, NoPermissionError, AuthenticationError)
#: Leading error codes (Redis ``server.c``/``replication.c`` replies) of a server that
#: refuses work, for the codes redis-py leaves as a plain ``ResponseError``; a
#: script's ``redis.call`` error keeps the code at the start of the message.
REFUSAL_CODES = ("READONLY", "OOM", "MISCONF", "LOADING", "BUSY", "MASTERDOWN",
                 "NOREPLICAS", "CLUSTERDOWN", "TRYAGAIN", "NOAUTH", "NOPERM", "WRONGPASS")
#: Key :meth:`RedisStore.ping` writes (with a 1 s expiry) to check that Redis accepts writes.
PROBE_KEY = "sluice:probe"


def refuses_work(error: RedisError) -> bool:
    """Whether ``error`` means the Redis server answers but refuses the work (an
    outage of the store: fail open or closed), as opposed to a bug in what was sent."""
    if isinstance(error, (*_OUTAGES, *_REFUSALS)):
        return True
    if not isinstance(error, ResponseError):
        return False
    code = str(error).split(" ", 1)[0].upper()
    return code in REFUSAL_CODES


class RedisStore:
    """GCRA buckets and expiring leases in Redis.

    Args:
        client: a ``redis.asyncio.Redis``; use :meth:`from_url` for the right
            timeouts. The store owns it and closes it in :meth:`close`.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self.failovers = 0  # it raises StoreUnavailable; FailoverStore counts the outages
        self.pending_releases = 0  # and keeps the releases that could not land
        self._take = client.register_script(_TAKE)
        self._adjust = client.register_script(_ADJUST)
        self._acquire = client.register_script(_ACQUIRE)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.25) -> RedisStore:
        """Connect lazily to ``url`` with connect and read timeouts of ``timeout_s``
        seconds and one immediate reconnect attempt (a pooled connection may be stale
        after a Redis restart)."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        return cls(client)

    async def take(self, buckets: Sequence[Bucket]) -> TakeResult:
        if not buckets:
            return TakeResult(True)
        args: list[float] = []
        for b in buckets:
            args += [b.cost, b.rate_per_s, b.burst]
        reply = await self._run(self._take, [b.key for b in buckets], [*args, EPSILON_S])
        if int(reply[0]) == 1:
            return TakeResult(True)
        return TakeResult(False, float(reply[1]), int(reply[2]))

    async def adjust(self, bucket: Bucket) -> None:
        await self._run(self._adjust, [bucket.key], [bucket.cost, bucket.rate_per_s])

    async def acquire(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        return int(await self._run(self._acquire, [key], [lease_id, limit, ttl_s])) == 1

    async def release(self, key: str, lease_id: str) -> None:
        await self.release_many([(key, lease_id)])

    async def release_many(self, leases: Sequence[tuple[str, str]]) -> None:
        """Remove each ``(key, lease id)`` in one pipelined round trip."""
        if not leases:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, lease_id in leases:
                    pipe.zrem(key, lease_id)
                await pipe.execute()
        except (RedisError, OSError) as e:
            _raise_if_outage(e)
            raise

    async def ping(self) -> None:
        """One write round trip (``SET`` :data:`PROBE_KEY` with a 1 s expiry): Redis
        answers *and* accepts writes (a read-only replica or a full ``noeviction``
        Redis answers ``PING`` but refuses every take).

        Raises:
            StoreUnavailable: it does not answer in time or refuses the write."""
        try:
            await self._client.set(PROBE_KEY, b"1", px=1000)
        except (RedisError, OSError) as e:
            _raise_if_outage(e)
            raise

    async def close(self) -> None:
        await self._client.aclose()

    @staticmethod
    async def _run(script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as e:
            _raise_if_outage(e)
            raise


def _raise_if_outage(error: Exception) -> None:
    """Raise :class:`StoreUnavailable` from ``error`` if it is an outage
    (:func:`refuses_work`); return otherwise (the caller re-raises ``error``: a script
    or logic bug is not an outage)."""
    if isinstance(error, OSError) or (isinstance(error, RedisError) and refuses_work(error)):
        raise StoreUnavailable(f"{type(error).__name__}: {error}") from error
