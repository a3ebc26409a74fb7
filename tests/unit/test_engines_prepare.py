"""prepare_model's idempotency rules and path resolution. The conversion itself
(about a minute) runs for real in tests/e2e/test_engine_real.py; here it is replaced
by a stand-in that writes what a finished conversion writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines import prepare
from engines.prepare import (
    MARKER,
    PACKAGED_GEMMA,
    RECIPE_VERSION,
    default_cache_dir,
    main,
    prepare_model,
    resolve_model_path,
)


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    done: list[Path] = []

    def convert(gguf_dir: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION}))
        done.append(out)

    monkeypatch.setattr(prepare, "_convert", convert)
    return done


def test_converts_once(tmp_path: Path, conversions: list[Path]) -> None:
    first = prepare_model(tmp_path)
    assert first == tmp_path / "gemma3-270m" and (first / "config.json").exists()
    assert prepare_model(tmp_path) == first
    assert len(conversions) == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [
        "gemma3-270m"]  # the staging folder is gone


def test_half_written_or_old_folder_is_redone(tmp_path: Path, conversions: list[Path]) -> None:
    stale = tmp_path / "gemma3-270m"
    stale.mkdir()
    (stale / "leftover.bin").write_text("partial")
    prepare_model(tmp_path)
    assert len(conversions) == 1 and not (stale / "leftover.bin").exists()
    (stale / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION - 1}))
    prepare_model(tmp_path)
    assert len(conversions) == 2


def test_resolve_maps_only_the_packaged_name(tmp_path: Path, conversions: list[Path]) -> None:
    assert resolve_model_path("/models/llama", tmp_path) == "/models/llama"
    assert conversions == []
    assert resolve_model_path(PACKAGED_GEMMA, tmp_path) == str(tmp_path / "gemma3-270m")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_MODEL_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SLUICE_MODEL_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "sluice" / "models"


def test_main_prints_the_folder(tmp_path: Path, conversions: list[Path],
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "gemma3-270m")


def test_main_reports_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["--cache-dir", str(blocker)]) == 1
    assert "prepare-model:" in capsys.readouterr().err
