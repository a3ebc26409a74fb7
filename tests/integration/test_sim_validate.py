"""validate-sim end to end, with a second simulated engine standing in for the real
one (same profile and speed, so relative errors must be small)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from loadtest import validate_sim
from tests.conftest import free_port
from tests.support import wait_for_sync


def test_validate_sim_against_a_sim(tmp_path, capsys):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim_engine", "--port", str(port),
                             "--model", "gemma3-270m", "--speed", "10"])
    try:
        def healthy() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                return True
            except OSError:
                return False

        wait_for_sync(healthy, 20, "the simulator to listen")
        out = tmp_path / "v.json"
        rc = validate_sim.main(["--real", f"http://127.0.0.1:{port}", "--speed", "10",
                                "--prompt-lens", "16,372", "--concurrency", "1,4",
                                "--output-tokens", "16", "--reps", "1", "--json", str(out),
                                "--closed-loop", "4", "--closed-loop-s", "2",
                                "--sim-profile", "cpu-gemma3-270m-quiet"])
    finally:
        proc.terminate()
        proc.wait(10)
    assert rc == 0
    assert "rel.err" in capsys.readouterr().out
    rows = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    # Both sides run at speed 10 and are reported as-is for the real side, scaled
    # for the sim side; compare the sim's own scaled numbers to the profile instead.
    assert rows["prefix_cache_hits_delta"]["real"] == 256  # 372 tokens → 2 blocks of 128
    assert rows["prefix_cache_hits_delta"]["sim"] == 256
    assert rows["prefix_cache_queries_delta"]["sim"] == 744
    # Sim TTFT at 372 tokens ≈ 44 + 1.19 × 372 ms of device time (+ HTTP, × speed).
    assert 450 < rows["ttft_ms@prompt=372"]["sim"] < 800
    # the closed-loop rows: the same engine on both sides answers
    assert rows["closed_loop_answered_per_s@clients=4"]["real"] > 0
    assert rows["closed_loop_latency_ms_p50@clients=4"]["sim"] > 0
