"""Smoke test of ``python -m loadtest overhead``: a tiny run through all three paths
and four cells; checks the JSON's shape and that every request succeeded, not the
timings (CI machines are shared)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.overhead import CELLS, METRICS, NO_TURN_CACHE, PATHS, _long_available

# load: runs `loadtest overhead` for a fixed duration
pytestmark = pytest.mark.load

ROOT = Path(__file__).resolve().parents[2]
SHORT = [c for c in CELLS if c != "long"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("observability", ["off"])
def test_overhead_json_shape(tmp_path: Path, observability: str) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "loadtest", "overhead", "--json", str(out),
         "--duration", "0.3", "--warmup", "0.1", "--observability", observability,
         "--cells", ",".join(SHORT), "--gateway-log", str(tmp_path / "gateway.log")],
        cwd=ROOT, check=True, timeout=280, capture_output=True,
    )
    doc = json.loads(out.read_text())
    for path in PATHS:
        assert set(SHORT) == set(doc[path]), path
        for cell in SHORT:
            r = doc[path][cell]
            for key in METRICS:
                assert isinstance(r[key], (int, float)), (path, cell, key, r)
            assert r["rps"] > 0 and r["errors"] == 0, (path, cell, r)
            assert r["p50_ms"] <= r["p99_ms"]
    assert isinstance(doc["ratio_gateway_passthrough_c64"], float)
    assert isinstance(doc["added_p50_ms_c1"], float)
    assert isinstance(doc["ratio_responses_chat_cpu"], float)
    assert doc["meta"]["observability"] == observability


@pytest.mark.timeout(300)
def test_overhead_workers_keys(tmp_path: Path) -> None:
    """``--workers 2`` adds the ``gateway_workers`` path and the per-worker-count keys,
    keeping the single-process ones."""
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "loadtest", "overhead", "--json", str(out),
         "--duration", "0.5", "--warmup", "0.2", "--cells", "c64",
         "--paths", "passthrough,gateway", "--workers", "2"],
        cwd=ROOT, check=True, timeout=280, capture_output=True,
    )
    doc = json.loads(out.read_text())
    assert set(doc["workers"]) == {"1", "2"}
    assert doc["workers"]["1"] == {"c64_rps": doc["gateway"]["c64"]["rps"],
                                   "cpu_ms_per_req": doc["gateway"]["c64"]["cpu_ms_per_req"]}
    w2 = doc["gateway_workers"]["c64"]
    assert w2["rps"] > 0 and w2["errors"] == 0 and w2["cpu_ms_per_req"] > 0, w2
    assert doc["workers"]["2"]["c64_rps"] == w2["rps"]
    assert isinstance(doc["ratio_gateway_passthrough_c64"], float)
    assert isinstance(doc["ratio_gateway_workers_passthrough_c64"], float)
    assert doc["meta"]["workers"] == 2


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _long_available(), reason="prepared gemma3-270m model not present")
def test_overhead_long_cell(tmp_path: Path) -> None:
    """The long cell runs on the gateway with and without the turn cache; a request
    whose earlier turns are cached costs the gateway less CPU."""
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "loadtest", "overhead", "--json", str(out), "--duration", "4",
         "--warmup", "2", "--cells", "long", "--paths", "gateway"],
        cwd=ROOT, check=True, timeout=280, capture_output=True,
    )
    doc = json.loads(out.read_text())
    for path in ("gateway", NO_TURN_CACHE):
        r = doc[path]["long"]
        assert r["rps"] > 0 and r["errors"] == 0, (path, r)
    cpu = doc["long_cpu_ms_per_req"]
    assert 0 < cpu["turn_cache"] < cpu["no_turn_cache"], cpu


@pytest.mark.asyncio
async def test_a_window_shorter_than_one_answer_still_measures() -> None:
    """A server slower than the whole measured window (a busy machine's first answers):
    the window goes on until each client has finished a request, so the cell has a
    rate and percentiles rather than 0 requests (seen in a fresh-clone ``make test``:
    ``gateway`` ``c16`` with 0.3 s windows)."""
    from aiohttp import web

    from loadtest.launch import free_port
    from loadtest.overhead import _generate

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(0.5)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        r = await _generate(f"http://127.0.0.1:{port}/v1/chat/completions", 3, False,
                            0.0, 0.1, [os.getpid()])
    finally:
        await runner.cleanup()
    assert r["requests"] >= 3 and r["errors"] == 0
    assert r["rps"] > 0 and r["p50_ms"] >= 500 and r["window_s"] >= 0.5
