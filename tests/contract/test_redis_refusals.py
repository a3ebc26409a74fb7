"""A Redis that answers but refuses work (read-only replica, ``OOM`` under
``noeviction``, ``MISCONF``) is an outage like an unreachable one: fail open or closed
as configured, one warning, recover by itself; and concurrency slots released while
Redis was away reach it when it returns (issue 39, items 7 and 8)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import ResponseError

from config.schema import TenantQuota
from limits.failover import FailoverStore
from limits.interfaces import Bucket, StoreUnavailable
from limits.outcome import Outcome, Rejected
from limits.rate_limit import RateLimiter
from limits.redis_store import refuses_work
from limits.stores import open_store
from tests.conftest import RedisServer, free_port
from tests.support import wait_for

BUCKET = Bucket("sluice:{t}:rpm", 1, 100 / 60, 100)
LEASES = "sluice:{t}:concurrent"


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    """A synchronous client; whatever a test breaks is undone afterwards."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.config_set("maxmemory", "0")
    client.replicaof("NO", "ONE")
    client.close()


async def wait_healthy(store: FailoverStore) -> None:
    await wait_for(lambda: store.healthy, timeout_s=10, what="the store to recover")


async def test_read_only_replica_fails_open_once_and_recovers(
        redis_url: str, admin: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(redis_url, failure="open")
    assert isinstance(store, FailoverStore)
    try:
        assert (await store.take([BUCKET])).allowed
        admin.replicaof("127.0.0.1", str(free_port()))  # a failover left us on a replica
        with caplog.at_level(logging.WARNING, logger="limits.failover"):
            for i in range(5):
                assert (await store.take([BUCKET])).allowed  # served locally, no 500
                assert await store.acquire(LEASES, f"local-{i}", 50, 60)
                await store.release(LEASES, f"local-{i}")
        assert store.failovers == 1 and not store.healthy
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "ReadOnlyError" in warnings[0].getMessage()
        with pytest.raises(StoreUnavailable):  # PING answers, but the recovery probe
            await store.primary.ping()  # writes: the store stays down while read-only
        admin.replicaof("NO", "ONE")
        await wait_healthy(store)
        admin.delete(BUCKET.key)
        assert (await store.take([BUCKET])).allowed
        assert admin.exists(BUCKET.key)  # back on the shared store
        assert store.failovers == 1
    finally:
        await store.close()


async def test_out_of_memory_fails_closed_and_recovers(redis_url: str,
                                                       admin: redis.Redis) -> None:
    store = open_store(redis_url, failure="closed")
    assert isinstance(store, FailoverStore)
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        for _ in range(3):
            with pytest.raises(Rejected) as exc:
                await store.take([BUCKET])
            assert exc.value.outcome is Outcome.OVERLOADED
            assert exc.value.reason == "store_unavailable"
        await store.adjust(BUCKET)  # finally-path calls never raise
        await store.release(LEASES, "x")
        assert store.failovers == 1
        admin.config_set("maxmemory", "0")
        await wait_healthy(store)
        assert (await store.take([BUCKET])).allowed
    finally:
        await store.close()


def test_refusals_are_told_from_bugs() -> None:
    misconf = ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's "
                            "currently unable to persist to disk.")
    busy = ResponseError("BUSY Redis is busy running a script.")
    noreplicas = ResponseError("NOREPLICAS Not enough good replicas to write.")
    assert refuses_work(misconf) and refuses_work(busy) and refuses_work(noreplicas)
    bug = ResponseError("ERR user_script:3: Script attempted to access nonexistent global")
    wrongtype = ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    assert not refuses_work(bug) and not refuses_work(wrongtype)


async def test_script_bug_is_not_an_outage(redis_url: str, admin: redis.Redis) -> None:
    """A reply that is the gateway's own fault still raises: it must be seen."""
    store = open_store(redis_url, failure="open")
    assert isinstance(store, FailoverStore)
    try:
        admin.set(LEASES, "not a sorted set")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await store.acquire(LEASES, "a", 2, 60)
        assert store.healthy and store.failovers == 0
    finally:
        await store.close()


async def test_releases_during_an_outage_reach_redis_when_it_returns(
        redis_url: str, redis_server: RedisServer, admin: redis.Redis) -> None:
    """Two leases in Redis; Redis paused (SIGSTOP) while both requests end; resumed:
    the slots are free in Redis, not held until ``lease_ttl_s``."""
    store = open_store(redis_url, failure="open", timeout_s=0.2)
    assert isinstance(store, FailoverStore)
    tenant = TenantQuota(name="t", max_concurrent=2)
    limiter = RateLimiter(store)
    assert redis_server.proc is not None
    try:
        first = await limiter.reserve(tenant, 0, request_id="r1")
        second = await limiter.reserve(tenant, 0, request_id="r2")
        assert admin.zcard(LEASES) == 2
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            await first.release()
            await second.release()
            assert not store.healthy
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await wait_healthy(store)
        assert admin.zcard(LEASES) == 0
        assert store.pending_releases == 0  # sluice_limits_pending_releases
        async with await limiter.reserve(tenant, 0, request_id="r3"), \
                await limiter.reserve(tenant, 0, request_id="r4"):
            assert admin.zcard(LEASES) == 2  # both slots, from Redis
    finally:
        await store.close()


async def test_pending_releases_are_bounded(redis_url: str, redis_server: RedisServer,
                                            admin: redis.Redis) -> None:
    store = open_store(redis_url, failure="open", timeout_s=0.2, max_pending_releases=1)
    assert isinstance(store, FailoverStore)
    assert redis_server.proc is not None
    try:
        for i in range(3):
            assert await store.acquire(LEASES, f"l{i}", 5, 60)
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(3):
                await store.release(LEASES, f"l{i}")
            assert store.pending_releases == 1 and store.dropped_releases == 2
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await wait_healthy(store)
        # the newest release was replayed; the first may have reached Redis before the
        # pause timed out; what the bound dropped stays until its lease expires
        assert b"l2" not in admin.zrange(LEASES, 0, -1)
    finally:
        await store.close()


async def test_an_acquire_that_timed_out_is_undone_when_redis_resumes(
        redis_url: str, redis_server: RedisServer, admin: redis.Redis) -> None:
    """A paused Redis runs the acquire that timed out once it continues: that lease
    (the request holds its slot locally) is removed on recovery, not left 600 s."""
    store = open_store(redis_url, failure="open", timeout_s=0.2)
    assert isinstance(store, FailoverStore)
    assert redis_server.proc is not None
    try:
        assert await store.acquire(LEASES, "early", 5, 60)  # script loaded, connected
        await store.release(LEASES, "early")
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            assert await store.acquire(LEASES, "late", 5, 60)  # locally
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await wait_healthy(store)
        assert admin.zcard(LEASES) == 0
        await store.release(LEASES, "late")
    finally:
        await store.close()
