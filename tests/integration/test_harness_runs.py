"""The fault and soak runs in short modes (``python -m loadtest faults --quick``,
``python -m loadtest soak --minutes 0.5``) and their invariants: nothing accepted is
lost, nothing is left held, no reservation is overshot, no server errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# load: each test runs a benchmark harness for a fixed duration
pytestmark = [pytest.mark.timeout(600), pytest.mark.load]


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """The run's JSON report and its stderr (which names lost requests and leftovers)."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "loadtest", *args, "--json", str(out),
                           "--out-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=540,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr[-3000:]


def test_faults_quick_loses_nothing(tmp_path: Path) -> None:
    r, log = _run(tmp_path, "faults", "--quick")
    assert set(r["per_fault"]) == {"baseline", "engine_kill", "engine_hang", "redis_restart",
                                   "tenants_replace", "tenants_truncate", "client_disconnect",
                                   "slow_reader"}
    assert r["accepted"] == r["completed"] + r["failed_cleanly"] + r["lost"]
    assert r["accepted"] == sum(f["accepted"] for f in r["per_fault"].values())
    assert r["completed"] > r["accepted"] / 2, r  # the load was served, not just refused
    assert r["lost"] == 0, (r, log)
    assert r["leftovers"] == {}, (r, log)
    assert r["overshoot_tokens"] == 0, (r, log)


def test_soak_short_has_no_server_errors(tmp_path: Path) -> None:
    r, log = _run(tmp_path, "soak", "--minutes", "0.5", "--engines", "2", "--capacity", "1.5",
             "--drain", "10")
    assert r["offered"] > 0.8 * 10 * 1.5 * 30, r  # 10x the given capacity was offered
    assert r["admitted"] > 0, r
    assert r["server_errors"] == 0, (r, log)
    assert r["rss_mb_start"] > 0 and r["rss_mb_end"] > 0, r
    assert r["config"]["changed"]["engines.supervisor.metrics_interval_s"]["value"] == 0.25
