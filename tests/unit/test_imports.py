"""Every module imports on its own (no import cycle hidden by import order), and the
package graph of docs/architecture.md holds: ``limits``, ``cache`` and ``engines``
never import ``gateway``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "limits", "cache", "engines", "config", "batch")


def modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_module_imports_first_in_a_fresh_module_table() -> None:
    script = (
        "import importlib, sys\n"
        f"pkgs = {PACKAGES!r}\n"
        "failed = []\n"
        f"for m in {modules()!r}:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] in pkgs]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{m}: {e!r}')\n"
        "print('\\n'.join(failed))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", run.stdout


def test_lower_packages_never_import_the_gateway() -> None:
    offenders = []
    for pkg in ("limits", "cache", "engines", "config", "batch"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                              if n.split(".")[0] == "gateway"]
    assert offenders == []
