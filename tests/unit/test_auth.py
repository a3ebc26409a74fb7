"""API key -> tenant (``gateway/auth.py``)."""

from __future__ import annotations

import pytest

from config.schema import TenantsConfig
from gateway.auth import TenantDirectory, hash_key
from limits.outcome import Outcome, Rejected


def test_tenant_directory():
    cfg = TenantsConfig.model_validate({
        "allow_anonymous": True,
        "tenants": [{"name": "a", "api_key_hashes": [hash_key("k1"), hash_key("k2")]},
                    {"name": "b", "api_key_hashes": [hash_key("k3")]}]})
    d = TenantDirectory(cfg)
    assert d.resolve("k2", "10.0.0.1").name == "a"
    assert d.resolve("k3", "127.0.0.1").name == "b"
    assert d.resolve(None, "127.0.0.1").name == "anonymous"
    assert d.resolve(None, "::1").name == "anonymous"
    for key, remote in [(None, "10.1.2.3"), ("nope", "127.0.0.1")]:
        with pytest.raises(Rejected) as e:
            d.resolve(key, remote)
        assert e.value.outcome.status == 401


def test_keys_that_are_not_utf8_or_empty_match_no_tenant():
    d = TenantDirectory(TenantsConfig.model_validate({"allow_anonymous": True}))
    for key in ("\udcff\udcfe", ""):  # aiohttp surrogate-escapes non-UTF-8 header bytes
        with pytest.raises(Rejected) as e:
            d.resolve(key, "127.0.0.1")
        assert e.value.outcome is Outcome.UNAUTHORIZED
