"""tenants.yaml reload on file change and SIGHUP; a bad file keeps the running config."""

from __future__ import annotations

import os
import signal

from gateway.auth import hash_key
from gateway.keys import RELOADER
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT
from tests.support import wait_for


def tenants_yaml(*keys: str) -> str:
    hashes = ", ".join(hash_key(k) for k in keys)
    return f"allow_anonymous: false\ntenants:\n  - name: acme\n    api_key_hashes: [{hashes}]\n"


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
        await wait_for(lambda: len(reloader.history) >= 1)
        assert reloader.history[-1].result == "ok"
        r = await gw.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer k2"})
        assert r.status == 200
        # a bad file: logged, recorded, and the running tenants stay
        path.write_text("tenants:\n  - name: acme\n    weight: -1\n")
        await wait_for(lambda: reloader.history[-1].result == "error")
        assert "tenants.0.weight" in reloader.history[-1].error
        assert (await gw.post("/v1/chat/completions", CHAT, headers=ok)).status == 200
        # SIGHUP reloads too
        n = len(reloader.history)
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_for(lambda: len(reloader.history) > n)
        assert reloader.history[-1].result == "error"  # still the bad file


def _reloaded(reloader, n: int, result: str = "ok"):
    """Predicate: more than ``n`` reload attempts were recorded and the last one had
    ``result`` (a file written in two steps, truncate then write, may be seen twice)."""
    return lambda: len(reloader.history) > n and reloader.history[-1].result == result


async def _status(gw, key: str) -> int:
    r = await gw.post("/v1/chat/completions", CHAT, headers={"Authorization": f"Bearer {key}"})
    return r.status


async def test_each_atomic_replace_with_mv_is_seen(engines, tmp_path):
    (fake,) = await engines(1)
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml("k1"))
    cfg = make_config([fake], tenants={"allow_anonymous": False})
    cfg = cfg.model_copy(update={"paths": {"tenants": str(path)}})
    async with run_gateway(cfg) as gw:
        reloader = gw.app[RELOADER]
        for key in ("k2", "k3", "k4"):  # what an editor's save or `mv new tenants.yaml` does
            n = len(reloader.history)
            tmp = tmp_path / f".tenants.yaml.{key}"
            tmp.write_text(tenants_yaml(key))
            os.replace(tmp, path)
            await wait_for(_reloaded(reloader, n))
            assert await _status(gw, key) == 200
            assert await _status(gw, "k1") == 401


async def test_configmap_style_symlink_swaps_are_seen(engines, tmp_path):
    """A Kubernetes ConfigMap volume: ``tenants.yaml -> ..data/tenants.yaml``, and an
    update writes a new timestamped folder and renames a new ``..data`` link over the
    old one."""
    (fake,) = await engines(1)

    def publish(version: int, key: str) -> None:
        folder = tmp_path / f"..2026_11_30_{version}"
        folder.mkdir()
        (folder / "tenants.yaml").write_text(tenants_yaml(key))
        (tmp_path / "..data_tmp").symlink_to(folder.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        old = tmp_path / f"..2026_11_30_{version - 1}"
        if old.exists():
            (old / "tenants.yaml").unlink()
            old.rmdir()

    publish(1, "k1")
    path = tmp_path / "tenants.yaml"
    path.symlink_to("..data/tenants.yaml")
    cfg = make_config([fake], tenants={"allow_anonymous": False})
    cfg = cfg.model_copy(update={"paths": {"tenants": str(path)}})
    async with run_gateway(cfg) as gw:
        reloader = gw.app[RELOADER]
        for version, key in ((2, "k2"), (3, "k3"), (4, "k4")):
            n = len(reloader.history)
            publish(version, key)
            await wait_for(_reloaded(reloader, n))
            assert await _status(gw, key) == 200
            assert await _status(gw, "k1") == 401


async def test_a_half_written_file_keeps_the_running_tenants(engines, tmp_path):
    (fake,) = await engines(1)
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml("k1"))
    cfg = make_config([fake], tenants={"allow_anonymous": False})
    cfg = cfg.model_copy(update={"paths": {"tenants": str(path)}})
    async with run_gateway(cfg) as gw:
        reloader = gw.app[RELOADER]
        path.write_text(tenants_yaml("k1", "k2"))
        await wait_for(_reloaded(reloader, 0))
        assert await _status(gw, "k2") == 200
        for half in ("", "# tenants, being rewritten\n"):  # truncated, mid-rewrite
            n = len(reloader.history)
            path.write_text(half)
            await wait_for(_reloaded(reloader, n, "error"))
            assert "tenants: []" in reloader.history[-1].error
            assert await _status(gw, "k2") == 200
        n = len(reloader.history)
        path.write_text("allow_anonymous: false\ntenants: []\n")  # no tenants, explicitly
        await wait_for(_reloaded(reloader, n))
        assert await _status(gw, "k2") == 401
