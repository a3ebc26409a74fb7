"""What ``sluice serve --workers N`` refuses and reports per process
(:func:`gateway.workers.check_sharing`), and the engine address file's round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config.schema import Config, EnginesConfig, GatewayConfig, TenantsConfig
from engines.addresses import EngineAddress, read_addresses, write_addresses
from engines.kv_events import EventsEndpoint
from engines.pool import Engine
from gateway.workers import check_sharing


def config(*, tenants: dict[str, Any], gateway: dict[str, Any] | None = None) -> Config:
    return Config(gateway=GatewayConfig.model_validate(gateway or {}),
                  engines=EnginesConfig.model_validate(
                      {"engines": [{"name": "e", "model": "m", "kind": "sim"}]}),
                  tenants=TenantsConfig.model_validate(tenants))


QUOTA = {"tenants": [{"name": "a"}, {"name": "b", "requests_per_min": 10}]}


def test_one_worker_has_nothing_to_share() -> None:
    assert check_sharing(config(tenants=QUOTA), 1) == []


def test_quota_on_memory_store_is_refused_naming_the_tenant() -> None:
    with pytest.raises(ValueError, match=r"limits.store_url.*\['b'\]|\['b'\].*limits.store_url"):
        check_sharing(config(tenants=QUOTA), 2)


def test_anonymous_quota_counts_only_when_anonymous_is_allowed() -> None:
    anon = {"allow_anonymous": True, "anonymous": {"name": "anonymous", "max_concurrent": 4}}
    with pytest.raises(ValueError, match="anonymous"):
        check_sharing(config(tenants=anon), 2)
    notes = check_sharing(config(tenants={**anon, "allow_anonymous": False}), 2)
    assert any("memory://" in n and "reload" in n for n in notes)


def test_redis_store_shares_quotas_and_the_memory_cache_is_reported() -> None:
    notes = check_sharing(config(tenants=QUOTA,
                                 gateway={"limits": {"store_url": "redis://127.0.0.1:1/0"}}), 3)
    assert not any("limits.store_url" in n for n in notes)
    assert any("cache.store_url is memory://" in n for n in notes)
    shared_cache = config(tenants=QUOTA, gateway={
        "limits": {"store_url": "redis://127.0.0.1:1/0"},
        "cache": {"store_url": "redis://127.0.0.1:1/1"}})
    assert not any("cache.store_url" in n for n in check_sharing(shared_cache, 3))


def test_address_file_round_trip(tmp_path: Path) -> None:
    events = EventsEndpoint("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv@e-0")
    a = Engine(id="e-0", model="m", base_url="http://127.0.0.1:9000")
    a.kv_events = events
    b = Engine(id="e-1", model="m", base_url="http://127.0.0.1:9001")
    path = tmp_path / "engines.json"
    write_addresses(path, [a, b])
    assert read_addresses(path) == {"e-0": EngineAddress("http://127.0.0.1:9000", events),
                                    "e-1": EngineAddress("http://127.0.0.1:9001", None)}
    assert not path.with_name("engines.json.tmp").exists()
    path.write_text('{"e-0": {"url": "x"}}')
    with pytest.raises(ValueError, match="not an engine address table"):
        read_addresses(path)
