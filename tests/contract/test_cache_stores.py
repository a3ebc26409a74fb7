"""Byte stores and the exact cache against memory and a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cache.exact import ExactCache
from cache.interfaces import ByteStore
from cache.stores import MemoryByteStore, RedisByteStore
from tests.support import ManualClock, wait_for


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ByteStore]:
    if request.param == "memory":
        s: ByteStore = MemoryByteStore(max_bytes=1 << 20)
    else:
        s = RedisByteStore(aioredis.Redis.from_url(request.getfixturevalue("redis_url")))
    yield s
    await s.close()


async def test_get_set_roundtrip_and_missing_key(store: ByteStore):
    assert await store.get("k") is None
    await store.set("k", b"v1", ttl_s=60)
    assert await store.get("k") == b"v1"
    await store.set("k", b"v2", ttl_s=60)
    assert await store.get("k") == b"v2"


async def test_entries_expire_after_their_ttl(store: ByteStore):
    await store.set("short", b"x", ttl_s=0.2)
    await store.set("long", b"y", ttl_s=60)
    assert await store.get("short") == b"x"

    async def short_gone() -> bool:
        return await store.get("short") is None

    await wait_for(short_gone, timeout_s=2, what="the 0.2 s entry to expire")  # Redis's own clock
    assert await store.get("long") == b"y"


async def test_redis_ttl_is_set_per_entry(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    exact = ExactCache(RedisByteStore(client), default_ttl_s=3600)
    await exact.put("aa", {"choices": []}, ttl_s=30)
    await exact.put("bb", {"choices": []})
    assert 0 < await client.pttl("sluice:cache:x:aa") <= 30_000
    assert 30_000 < await client.pttl("sluice:cache:x:bb") <= 3_600_000
    assert await exact.get("aa") == {"choices": []}
    await client.aclose()


async def test_memory_store_is_lru_bounded_by_bytes():
    store = MemoryByteStore(max_bytes=100)  # key + value bytes
    for k in ("a", "b", "c"):
        await store.set(k, b"x" * 29, ttl_s=60)  # 30 bytes each
    assert store.used_bytes == 90
    assert await store.get("a") == b"x" * 29  # a is now most recently used
    await store.set("d", b"x" * 29, ttl_s=60)  # 120 > 100: evict LRU = b
    assert store.used_bytes == 90 and len(store) == 3
    assert await store.get("b") is None
    assert await store.get("a") is not None and await store.get("c") is not None
    await store.set("huge", b"x" * 200, ttl_s=60)  # larger than the cap: not stored
    assert await store.get("huge") is None and store.used_bytes == 90
    await store.set("a", b"", ttl_s=60)  # overwrite frees the old size
    assert store.used_bytes == 61


async def test_memory_store_expiry_uses_the_injected_clock():
    clock = ManualClock(t=0.0)
    store = MemoryByteStore(max_bytes=1000, clock=clock)
    await store.set("k", b"v", ttl_s=10)
    clock.t = 9.9
    assert await store.get("k") == b"v"
    clock.t = 10.0
    assert await store.get("k") is None and store.used_bytes == 0
