"""What a benchmark's config changes from the shipped one, with the reason, for its
report (``config.changed``): every benchmark measures the shipped configuration, and a
setting it changes is printed.

:func:`changed_settings` compares the ``gateway.yaml`` and ``engines.yaml`` a benchmark
wrote with the shipped files (``config/``, parsed by the schema, so a key the shipped
file leaves out counts at its default). The engine list is the benchmark's own fleet and
``tenants.yaml`` its own tenants; neither is compared.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from config.loader import DEFAULT_DIR, load_file

#: Files compared, and the keys of each that are the benchmark's own.
COMPARED: dict[str, frozenset[str]] = {"gateway": frozenset(), "engines": frozenset({"engines"})}


@cache
def shipped(kind: str) -> dict[str, Any]:
    """The shipped ``config/KIND.yaml`` with every default filled in (the schema's
    ``model_dump``)."""
    return load_file(kind, DEFAULT_DIR / f"{kind}.yaml").model_dump(mode="json")


def _leaves(data: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(data, Mapping):  # an empty section leaves every default
        for k, v in data.items():
            yield from _leaves(v, f"{prefix}.{k}")
    else:
        yield prefix, data


def _lookup(data: Any, path: list[str]) -> Any:
    for key in path:
        if not isinstance(data, Mapping) or key not in data:
            return None
        data = data[key]
    return data


def changed_settings(folder: Path, reasons: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every setting of ``folder``'s ``gateway.yaml`` / ``engines.yaml`` that differs
    from the shipped value (both as the schema parses them: a list of plugins compares
    with its defaults filled in), as ``{"engines.supervisor.metrics_interval_s": {"value":
    0.25, "shipped": 1.0, "why": ...}}``.

    Args:
        folder: a config folder a benchmark wrote.
        reasons: why, per dotted setting (``FILE.key.key``), or per section (a prefix
            such as ``engines.saturation``) for every setting under it.

    Raises:
        KeyError: a changed setting has no reason (a benchmark may not change the
            shipped configuration silently).
        config.loader.ConfigError: a file the benchmark wrote does not validate.
    """
    out: dict[str, dict[str, Any]] = {}
    for kind, own in COMPARED.items():
        file = folder / f"{kind}.yaml"
        written = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        parsed = load_file(kind, file).model_dump(mode="json")  # defaults filled in
        base = shipped(kind)
        for key, value in written.items():
            if key in own:
                continue
            for path, _ in _leaves(value, f"{kind}.{key}"):
                keys = path.split(".")[1:]
                leaf, was = _lookup(parsed, keys), _lookup(base, keys)
                if leaf == was:
                    continue
                why = next((reasons[p] for p in _prefixes(path) if p in reasons), None)
                if why is None:
                    raise KeyError(f"{path} = {leaf!r} (shipped {was!r}) is changed with no "
                                   "reason given")
                out[path] = {"value": leaf, "shipped": was, "why": why}
    return out


def _prefixes(path: str) -> Iterator[str]:
    parts = path.split(".")
    for i in range(len(parts), 1, -1):
        yield ".".join(parts[:i])
