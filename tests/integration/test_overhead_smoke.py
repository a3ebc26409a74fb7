"""Smoke test of ``python -m loadtest overhead``: a tiny run through all three paths
and four cells; checks the JSON's shape and that every request succeeded, not the
timings (CI machines are shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.overhead import CELLS, METRICS, PATHS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("observability", ["off"])
def test_overhead_json_shape(tmp_path: Path, observability: str) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "loadtest", "overhead", "--json", str(out),
         "--duration", "0.3", "--warmup", "0.1", "--observability", observability,
         "--gateway-log", str(tmp_path / "gateway.log")],
        cwd=ROOT, check=True, timeout=280, capture_output=True,
    )
    doc = json.loads(out.read_text())
    for path in PATHS:
        assert set(CELLS) <= set(doc[path]), path
        for cell in CELLS:
            r = doc[path][cell]
            for key in METRICS:
                assert isinstance(r[key], (int, float)), (path, cell, key, r)
            assert r["rps"] > 0 and r["errors"] == 0, (path, cell, r)
            assert r["p50_ms"] <= r["p99_ms"]
    assert isinstance(doc["ratio_gateway_passthrough_c64"], float)
    assert isinstance(doc["added_p50_ms_c1"], float)
    assert doc["meta"]["observability"] == observability
