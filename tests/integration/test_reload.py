"""tenants.yaml reload on file change and SIGHUP; a bad file keeps the running config."""

from __future__ import annotations

import asyncio
import os
import signal

from gateway.auth import hash_key
from gateway.keys import RELOADER
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT


def tenants_yaml(*keys: str) -> str:
    hashes = ", ".join(hash_key(k) for k in keys)
    return f"allow_anonymous: false\ntenants:\n  - name: acme\n    api_key_hashes: [{hashes}]\n"


async def _until(pred, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_reload_on_change_and_bad_file_keeps_config(engines, tmp_path):
    (fake,) = await engines(1)
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml("k1"))
    cfg = make_config([fake], tenants={"allow_anonymous": False})
    cfg = cfg.model_copy(update={"paths": {"tenants": str(path)}})
    async with run_gateway(cfg) as gw:
        reloader = gw.app[RELOADER]
        ok = {"Authorization": "Bearer k1"}
        # the file on disk is loaded when the gateway (re)loads; the first change:
        path.write_text(tenants_yaml("k1", "k2"))
        await _until(lambda: len(reloader.history) >= 1)
        assert reloader.history[-1].result == "ok"
        r = await gw.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer k2"})
        assert r.status == 200
        # a bad file: logged, recorded, and the running tenants stay
        path.write_text("tenants:\n  - name: acme\n    weight: -1\n")
        await _until(lambda: reloader.history[-1].result == "error")
        assert "tenants.0.weight" in reloader.history[-1].error
        assert (await gw.post("/v1/chat/completions", CHAT, headers=ok)).status == 200
        # SIGHUP reloads too
        n = len(reloader.history)
        os.kill(os.getpid(), signal.SIGHUP)
        await _until(lambda: len(reloader.history) > n)
        assert reloader.history[-1].result == "error"  # still the bad file
