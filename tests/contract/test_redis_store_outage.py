"""Redis taken away mid-run: fail open keeps answering, fail closed rejects with 503,
and both recover by themselves when Redis returns."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from limits.failover import FailoverStore
from limits.interfaces import Bucket
from limits.outcome import Outcome, Rejected
from limits.stores import open_store
from tests.conftest import RedisServer
from tests.support import wait_for

BUCKET = Bucket("sluice:{t}:rpm", 1, 100 / 60, 100)


async def wait_healthy(store: FailoverStore) -> None:
    await wait_for(lambda: store.healthy, timeout_s=10, what="the store to recover")


def redis_has(url: str, key: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(client.exists(key))
    finally:
        client.close()


@pytest.mark.load
async def test_fail_open_answers_locally_and_recovers(
    redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(redis_url, failure="open")
    assert isinstance(store, FailoverStore)
    try:
        assert (await store.take([BUCKET])).allowed and redis_has(redis_url, BUCKET.key)
        assert await store.acquire("sluice:{t}:cc", "held-in-redis", 5, 60)
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="limits.failover"):
            started = time.monotonic()
            for i in range(20):
                assert (await store.take([BUCKET])).allowed
                assert await store.acquire("sluice:{t}:cc", f"local-{i}", 50, 60)
                await store.adjust(Bucket(BUCKET.key, -1, BUCKET.rate_per_s, BUCKET.burst))
                await store.release("sluice:{t}:cc", "held-in-redis")
            assert time.monotonic() - started < 2.0  # nobody waits on the dead Redis
        assert store.failovers == 1 and not store.healthy
        assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    finally:
        redis_server.start()
    try:
        await wait_healthy(store)
        assert (await store.take([BUCKET])).allowed
        assert redis_has(redis_url, BUCKET.key)  # back on the shared store
        assert store.failovers == 1
    finally:
        await store.close()


async def test_fail_closed_rejects_with_overloaded_and_recovers(
    redis_url: str, redis_server: RedisServer
) -> None:
    store = open_store(redis_url, failure="closed")
    assert isinstance(store, FailoverStore)
    try:
        assert (await store.take([BUCKET])).allowed
        redis_server.stop()
        for _ in range(3):
            with pytest.raises(Rejected) as exc:
                await store.take([BUCKET])
            assert exc.value.outcome is Outcome.OVERLOADED
            assert exc.value.retry_after_s and exc.value.retry_after_s > 0
            with pytest.raises(Rejected):
                await store.acquire("sluice:{t}:cc", "x", 5, 60)
        # finally-path calls never raise, even failing closed
        await store.adjust(BUCKET)
        await store.release("sluice:{t}:cc", "x")
    finally:
        redis_server.start()
    try:
        await wait_healthy(store)
        assert (await store.take([BUCKET])).allowed
    finally:
        await store.close()


@pytest.mark.load
async def test_unreachable_from_the_start_fails_open_fast() -> None:
    from tests.conftest import free_port

    store = open_store(f"redis://127.0.0.1:{free_port()}/0", failure="open", timeout_s=0.1)
    try:
        started = time.monotonic()
        assert (await store.take([BUCKET])).allowed
        assert time.monotonic() - started < 1.0
    finally:
        await store.close()
