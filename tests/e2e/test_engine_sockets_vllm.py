"""Issue 39 item 13, on the real engine: ``sluice serve`` with the shipped config
launches the CPU vLLM engine; after a request whose blocks the engine stores (so its
KV-event publisher has sent ``BlockStored``), every socket the whole process tree
listens on (the gateway, the API server, ``EngineCore``, workers; TCP in ``LISTEN``
and bound UDP) is loopback. The KV events travel over ``ipc://`` sockets in a private
folder instead of vLLM's ``tcp://*`` (every interface, unauthenticated).

Slow: one engine start (~60 s).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import psutil
import pytest

from loadtest.launch import gateway
from loadtest.workloads.base import synthetic_text
from tests.listening import exposed, listening

pytestmark = pytest.mark.slow
MODEL = "gemma3-270m"


def test_the_launched_engine_listens_on_loopback_only(tmp_path: Path) -> None:
    with gateway(log_path=tmp_path / "gateway.log") as gw:
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": synthetic_text("sockets", 400)}]}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": "Bearer sk-sluice-local"})
        assert r.status_code == 200, r.text
        tree = psutil.Process(gw.proc.pid).children(recursive=True)
        argvs = [p.cmdline() for p in tree]
        (flag,) = [json.loads(a[a.index("--kv-events-config") + 1])
                   for a in argvs if "--kv-events-config" in a]
        assert flag["enable_kv_cache_events"]
        for url in (flag["endpoint"], flag["replay_endpoint"]):
            assert url.startswith("ipc://"), flag
            path = Path(url.removeprefix("ipc://"))
            assert stat.S_ISSOCK(path.stat().st_mode)
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        sockets = listening(gw.proc.pid)
        print("listening:", sockets)
        assert len({s.pid for s in sockets}) >= 2, sockets  # the gateway and the engine
        assert not exposed(gw.proc.pid), exposed(gw.proc.pid)
