"""Scheduler plugin types and parameters are validated when engines.yaml loads:
`sluice check-config` (the real entry point, in a subprocess) names the file and
the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def engines_file(tmp_path: Path, scheduler: dict) -> Path:
    shipped = yaml.safe_load((ROOT / "config/engines.yaml").read_text())
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({**shipped, "scheduler": scheduler}))
    return path


def test_a_misspelt_scorer_type_names_file_field_and_valid_types(tmp_path: Path) -> None:
    path = engines_file(tmp_path, {"scorers": [{"type": "queue-depth"},
                                               {"type": "prefix-afinity", "weight": 2}]})
    done = check_config(path)
    assert done.returncode == 1, done.stdout
    assert f"{path}: scheduler.scorers.1.type = 'prefix-afinity': " in done.stderr
    assert "valid types: kv-cache-usage, least-in-flight, predicted-ttft, prefill-backlog, " \
        "prefix-affinity, queue-depth, session-affinity" in done.stderr
    assert "ok" not in done.stdout


def test_a_bad_parameter_names_its_field(tmp_path: Path) -> None:
    path = engines_file(tmp_path, {"filters": [{"type": "kv-watermark",
                                                "params": {"watermark": 1.5}},
                                               {"type": "load-guard",
                                                "params": {"abs_treshold": 4}}]})
    done = check_config(path)
    assert done.returncode == 1
    assert f"{path}: scheduler.filters.0.params.watermark = 1.5: " \
        "Input should be less than or equal to 1" in done.stderr
    assert f"{path}: scheduler.filters.1.params.abs_treshold = 4: " \
        "Extra inputs are not permitted" in done.stderr


def test_the_shipped_policy_passes(tmp_path: Path) -> None:
    done = check_config(ROOT / "config/engines.yaml")
    assert done.returncode == 0 and "ok (engines)" in done.stdout, done.stderr
