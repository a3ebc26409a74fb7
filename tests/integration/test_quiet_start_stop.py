"""What a newcomer sees from ``sluice serve`` (issue 39 item 18): starting with the
semantic cache on (faiss, the embedding model, torch) and stopping with Ctrl-C
(SIGINT) prints no traceback, no faiss loader error and none of the ``nanobind:
leaked`` lines Triton's bindings wrote at exit; the banner and the stop line remain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.limits_support import sim_engine, tenant, write_config
from tests.support import wait_for_sync

pytestmark = pytest.mark.timeout(240)

NOISE = ("Traceback", "ModuleNotFoundError", "Could not load library", "nanobind", "leaked")


def test_start_and_ctrl_c_print_no_noise(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tenants=[tenant("t")], engines=[sim_engine()],
                       gateway={"cache": {"enabled": True, "semantic": {"enabled": True}}})
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config-dir", str(cfg),
         "--port", str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for_sync(ready, 180, "the gateway to be ready")
        # the semantic cache's embedding model runs (torch imported and used)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       headers={"Authorization": "Bearer key-t"},
                       json={"model": "sim-model", "max_tokens": 2, "temperature": 0,
                             "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert "Sluice is serving the OpenAI API" in out and "Stopping: draining" in out
    found = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not found, "\n".join(found[:20])
