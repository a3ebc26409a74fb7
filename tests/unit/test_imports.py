"""The import rules of docs/architecture.md ("Packages", "Import rules"), checked on
the source: every module imports on its own (no cycle hidden by import order), no
import cycle between modules, and the package graph ``gateway`` → ``limits``,
``cache``, ``engines``, ``batch`` → ``config`` with its named exceptions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "limits", "cache", "engines", "config", "batch")

#: What each package may import of the project (``loadtest`` may import anything and
#: is not listed; nothing here may import it: only tests and ``loadtest`` itself do).
MAY_IMPORT = {
    "gateway": {"gateway", "limits", "cache", "engines", "config", "batch"},
    "limits": {"limits", "config"},
    "cache": {"cache", "config"},
    "engines": {"engines", "config"},
    "config": {"config"},
    "batch": {"batch", "config"},
}
#: The modules of ``limits`` every package may import: the interfaces (the clock, the
#: load and counter records) and the one clock everybody reads.
SHARED = {"limits.interfaces", "limits.clock"}
#: Deliberate exceptions, (file, imported module) → why; docs/architecture.md names
#: the same ones. The test fails when one is no longer needed, so the list stays true.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[str]:
    return [module_name(p) for p in sources()]


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: Path) -> list[tuple[str, bool]]:
    """The project modules ``path`` imports, anywhere in the file (functions too), as
    (module, only for type checking); ``from a import b`` is ``a.b`` when that is a
    module."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}")
                     else node.module for a in node.names]
        else:
            continue
        out += [(n, id(node) in typing_only) for n in names
                if n.split(".")[0] in (*PACKAGES, "loadtest")]
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


def test_packages_import_only_what_the_architecture_allows() -> None:
    offenders, used = [], set()
    for path in sources():
        rel = str(path.relative_to(ROOT))
        allowed = MAY_IMPORT[rel.split("/")[0]]
        for name, _ in imported(path):
            if name.split(".")[0] in allowed:
                continue
            if name in SHARED and rel.split("/")[0] != "config":
                continue
            if (rel, name) in EXCEPTIONS:
                used.add((rel, name))
                continue
            offenders.append(f"{rel}: {name}")
    assert offenders == []
    assert used == set(EXCEPTIONS), f"exceptions no longer needed: {set(EXCEPTIONS) - used}"


def test_no_import_cycle_between_modules() -> None:
    """Imports made only for type annotations (under ``if TYPE_CHECKING:``) do not
    run, and a submodule's import of its own package (``engines.kinds.vllm`` takes
    ``EngineKind`` from ``engines.kinds``, which gathers its submodules last) is the
    package's own business; every other import is an edge."""
    graph: dict[str, set[str]] = {}
    for path in sources():
        me = module_name(path)
        graph[me] = {n for n, typing_only in imported(path)
                     if not typing_only and n != me and not me.startswith(n + ".")
                     and n in graph.keys() | set(modules())}
    cycles, state = [], dict.fromkeys(graph, 0)

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state[n] == 1:  # n is on the path: a cycle
                path = [*stack, m]
                cycles.append(" -> ".join([*path[path.index(n):], n]))
            elif state[n] == 0:
                visit(n, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [])
    assert cycles == []
