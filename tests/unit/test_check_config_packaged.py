"""``sluice check-config`` refuses a ``packaged:`` model that Sluice does not ship
(issue 39 item 17): the error names the file, the field and the value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from config.schema import EngineSpec
from engines.prepare import PACKAGED_GEMMA


def write_engines(tmp_path: Path, **spec: str) -> Path:
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"name": "g", "model": "m", **spec}]}))
    return path


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_unknown_packaged_model_is_an_error_naming_file_field_and_value(tmp_path: Path) -> None:
    path = write_engines(tmp_path, kind="vllm", model_path="packaged:gemma3-999m")
    out = check_config(path)
    assert out.returncode == 1, out.stdout
    assert str(path) in out.stderr
    assert "engines.0.model_path" in out.stderr and "'packaged:gemma3-999m'" in out.stderr
    assert PACKAGED_GEMMA in out.stderr  # says what exists
    assert "ok" not in out.stdout


def test_the_shipped_packaged_model_and_plain_paths_pass(tmp_path: Path) -> None:
    out = check_config(write_engines(tmp_path, kind="vllm", model_path=PACKAGED_GEMMA))
    assert out.returncode == 0 and "ok (engines)" in out.stdout, out.stderr
    assert EngineSpec.model_validate({"name": "g", "model": "m", "kind": "vllm",
                                      "model_path": "/models/some-folder"}).model_path


@pytest.mark.parametrize("field", ["model_path", "tokenizer"])
def test_both_fields_that_take_a_packaged_model_check_it(field: str) -> None:
    with pytest.raises(ValidationError, match="no packaged model 'packaged:llama-1t'"):
        EngineSpec.model_validate({"name": "g", "model": "m", "kind": "llamacpp",
                                   "model_path": PACKAGED_GEMMA, field: "packaged:llama-1t"})
