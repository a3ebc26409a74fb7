"""Issue 39 item 13: the KV-event publisher of an engine Sluice launches is reachable
from this host only. Through ``sluice serve`` with launched simulated engines (which
bind endpoints as vLLM does): every socket the gateway's process tree listens on is
loopback, the events arrive over ``ipc://`` sockets in a 0700 folder, and the folder
is removed when the gateway stops. The same check against the real vLLM engine is
``tests/e2e/test_engine_sockets_vllm.py``."""

from __future__ import annotations

import json
import signal
import stat
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.limits_support import gateways, sim_engine, tenant, write_config
from tests.listening import exposed, listening
from tests.support import wait_for_sync

pytestmark = pytest.mark.timeout(120)


def test_launched_engines_listen_on_loopback_only(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tenants=[tenant("t")],
                       engines=[sim_engine("sim", replicas=2)])
    engines = yaml.safe_load((cfg / "engines.yaml").read_text())
    engines["scheduler"] = {"prefix": {"source": "events"}}
    (cfg / "engines.yaml").write_text(yaml.safe_dump(engines))
    with gateways(cfg, 1) as (gw,):
        # the gateway follows both publishers (synced), so the sockets exist
        def synced() -> bool:
            text = httpx.get(gw.url + "/metrics", timeout=5).text
            return text.count("sluice_engine_kv_events_synced{") == 2 and all(
                line.endswith(" 1.0") for line in text.splitlines()
                if line.startswith("sluice_engine_kv_events_synced{"))

        wait_for_sync(synced, 30, "the gateway to follow both engines' events")
        sockets = listening(gw.proc.pid)
        assert len({s.pid for s in sockets}) >= 3, sockets  # the gateway and both engines
        assert not exposed(gw.proc.pid), exposed(gw.proc.pid)
        argvs = [p.cmdline() for p in psutil.Process(gw.proc.pid).children(recursive=True)]
        flags = [json.loads(a[a.index("--kv-events-config") + 1])
                 for a in argvs if "--kv-events-config" in a]
        assert len(flags) == 2
        folders = set()
        for flag in flags:
            for url in (flag["endpoint"], flag["replay_endpoint"]):
                assert url.startswith("ipc://"), flag
                path = Path(url.removeprefix("ipc://"))
                assert stat.S_ISSOCK(path.stat().st_mode)
                folders.add(path.parent)
        (folder,) = folders
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(30) == 0
    assert not folder.exists()



def test_every_worker_follows_the_private_sockets(tmp_path: Path) -> None:
    """``--workers 2``: worker 1 reads the ``ipc://`` endpoints from worker 0's address
    file and follows the same publishers; still nothing but loopback listens."""
    from tests.integration.test_workers import metrics_port_pair, workers

    mport = metrics_port_pair()
    cfg = write_config(tmp_path, tenants=[tenant("t")], engines=[sim_engine("sim")],
                       gateway={"observability": {"access_log": False, "tracing": False,
                                                  "metrics_listen": f"127.0.0.1:{mport}"}})
    engines = yaml.safe_load((cfg / "engines.yaml").read_text())
    engines["scheduler"] = {"prefix": {"source": "events"}}
    (cfg / "engines.yaml").write_text(yaml.safe_dump(engines))
    with workers(cfg, mport) as w:
        def both_synced() -> bool:
            return all('sluice_engine_kv_events_synced{engine="sim",model="sim-model"} 1.0'
                       in httpx.get(u, timeout=5).text for u in w.metrics_urls)

        wait_for_sync(both_synced, 30, "both workers to follow the engine's events")
        assert not exposed(w.proc.pid), exposed(w.proc.pid)
