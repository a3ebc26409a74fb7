"""Through the gateway: a tenant with limits, the counters in a Redis that refuses
writes (a read-only replica after a failover), is served as ``redis_failure`` says
(open: 200; closed: 503 ``overloaded`` with ``Retry-After``), never a 500
(issue 39, item 7)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.conftest import free_port
from tests.integration.conftest import make_config, run_gateway
from tests.integration.limits_support import auth, tenant

TENANTS = {"tenants": [tenant("lim", requests_per_min=1000, tokens_per_min=100_000,
                              max_concurrent=4)]}
CHAT = {"model": "fake-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.replicaof("NO", "ONE")
    client.close()


@pytest.mark.parametrize(("failure", "status"), [("open", 200), ("closed", 503)])
async def test_read_only_redis_is_an_outage_not_a_500(engines, redis_url: str,
                                                      admin: redis.Redis, failure: str,
                                                      status: int) -> None:
    (engine,) = await engines(1)
    cfg = make_config([engine], tenants=TENANTS, gateway={
        "limits": {"store_url": redis_url, "redis_failure": failure}})
    async with run_gateway(cfg) as gw:
        async with await gw.post("/v1/chat/completions", CHAT, headers=auth("lim")) as r:
            assert r.status == 200
        admin.replicaof("127.0.0.1", str(free_port()))
        for _ in range(3):
            async with await gw.post("/v1/chat/completions", CHAT, headers=auth("lim")) as r:
                body = await r.json()
                assert r.status == status, body
                if status == 503:
                    assert body["error"]["code"] == "overloaded"
                    assert int(r.headers["Retry-After"]) >= 1
        admin.replicaof("NO", "ONE")
        await gw.idle()
