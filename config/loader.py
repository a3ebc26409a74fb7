"""Load and validate the YAML files into a :class:`~config.schema.Config`.

Errors raise :class:`ConfigError`, whose message names the file, the field path and
the bad value, e.g. ``tenants.yaml: tenants.0.weight = -1: Input should be greater
than 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from config.schema import (
    Config,
    EnginesConfig,
    GatewayConfig,
    TenantsConfig,
)

#: The folder holding the shipped default files (the embedded default).
DEFAULT_DIR = Path(__file__).resolve().parent
FILES: dict[str, type[BaseModel]] = {
    "gateway": GatewayConfig,
    "engines": EnginesConfig,
    "tenants": TenantsConfig,
}


class ConfigError(ValueError):
    """A configuration file is unreadable or invalid; ``str()`` is user-facing."""


#: What to write instead of an empty file, per kind.
EMPTY_HINT = {
    "gateway": "write `{}` for every default",
    "engines": "list at least one engine",
    "tenants": "write `tenants: []` for no tenants",
}


def _read_yaml(path: Path, kind: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:  # also what a file being rewritten looks like: never "no settings"
        raise ConfigError(f"{path}: the file is empty (or only comments); {EMPTY_HINT[kind]}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _lookup(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return "<missing>"
    return data


def _explain(path: Path, data: dict[str, Any], err: ValidationError) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if not loc:  # a check across the whole file: the message names what is wrong
            lines.append(f"{path}: {e['msg']}")
            continue
        field = ".".join(str(p) for p in loc) or "<top>"
        value = e.get("input") if e["type"] != "missing" else "<missing>"
        if value is None or isinstance(value, dict):
            value = _lookup(data, loc)
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"{path}: {field} = {shown}: {e['msg']}")
    return ConfigError("\n".join(lines))


def _merge_tenant_defaults(data: dict[str, Any]) -> dict[str, Any]:
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        return data
    out = dict(data)
    if isinstance(data.get("tenants"), list):
        out["tenants"] = [
            {**defaults, **t} if isinstance(t, dict) else t for t in data["tenants"]
        ]
    anon = data.get("anonymous") or {}
    if isinstance(anon, dict):
        out["anonymous"] = {"name": "anonymous", **defaults, **anon}
    return out


def load_file(kind: str, path: Path) -> BaseModel:
    """Parse one file; ``kind`` is ``gateway``, ``engines`` or ``tenants``.

    Raises:
        ConfigError: unreadable or empty file, bad YAML, or a field that fails
            validation.
    """
    data = _read_yaml(path, kind)
    if kind == "tenants":
        data = _merge_tenant_defaults(data)
    try:
        parsed = FILES[kind].model_validate(data)
    except ValidationError as e:
        raise _explain(path, data, e) from None
    if kind == "engines" and not parsed.engines:  # type: ignore[attr-defined]
        raise ConfigError(f"{path}: engines = []: at least one engine is needed")
    return parsed


def load_config(
    gateway: Path | str | None = None,
    engines: Path | str | None = None,
    tenants: Path | str | None = None,
    *,
    directory: Path | str | None = None,
) -> Config:
    """Load the three files. Each file defaults to ``directory/NAME.yaml`` and the
    directory defaults to the shipped :data:`DEFAULT_DIR`.

    Raises:
        ConfigError: see :func:`load_file`; also when a tenant names a model that no
            engine serves.
    """
    base = Path(directory) if directory else DEFAULT_DIR
    chosen = {"gateway": gateway, "engines": engines, "tenants": tenants}
    parts: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for kind, p in chosen.items():
        path = Path(p) if p else base / f"{kind}.yaml"
        parts[kind] = load_file(kind, path)
        paths[kind] = str(path)
    cfg = Config(**parts, paths=paths)
    check_cross_refs(cfg)
    return cfg


def check_cross_refs(cfg: Config) -> None:
    """Checks that span files: a tenant's allowed model or a fallback model must be
    served by some engine.

    Raises:
        ConfigError: naming the file and field.
    """
    served = set(cfg.engines.model_names())
    for i, t in enumerate(cfg.tenants.tenants):
        for m in t.allowed_models or []:
            if m not in served:
                raise ConfigError(
                    f"{cfg.paths.get('tenants')}: tenants.{i}.allowed_models = {m!r}: "
                    f"no engine serves this model (served: {sorted(served)})"
                )
    for i, m in enumerate(cfg.engines.models):
        fb = m.degradation.fallback_model
        if fb and fb not in served:
            raise ConfigError(
                f"{cfg.paths.get('engines')}: models.{i}.degradation.fallback_model = "
                f"{fb!r}: no engine serves this model"
            )
