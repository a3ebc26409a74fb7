"""Shared fixtures: free ports and a private ``redis-server`` for the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from loadtest.launch import RedisServer, free_port  # noqa: F401  (free_port: re-exported)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the private Redis, flushed before each test."""
    import redis

    if redis_server.proc is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url
