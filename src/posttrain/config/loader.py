"""Reading config files: YAML with clear errors, ``defaults: - model: [...]``, dotted overrides.

This module works on plain dicts; :mod:`posttrain.config.schema` turns them into typed sections.
It is shared by training configs (``configs/*.yaml``) and dataset configs
(``configs/datasets/*.yaml``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import ConfigError
from posttrain.paths import configs_dir


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse one YAML file into a dict; errors name the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError(f"{path}: malformed YAML at {where}: {err.problem or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def resolve_config_file(name: str, config_path: str | Path | None, subdir: str = "") -> Path:
    """``--config-name NAME`` (with or without ``.yaml``) in ``--config-path`` or ``configs/<subdir>``."""
    folder = Path(config_path) if config_path else configs_dir() / subdir
    candidates = [Path(name)] if Path(name).suffix in (".yaml", ".yml") else []
    file_name = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    candidates.append(folder / file_name)
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    hint = f" Known configs there: {', '.join(known)}." if known else ""
    raise ConfigError(f"config '{name}' not found: {folder / file_name} does not exist.{hint}")


def load_model_yaml(name_or_path: str, model_dir: Path | None = None) -> tuple[str, dict[str, Any]]:
    """Load ``configs/model/<name>.yaml`` (or a path); returns ``(name, keys)``."""
    path = Path(name_or_path)
    if not path.suffix:
        path = (model_dir or configs_dir() / "model") / f"{name_or_path}.yaml"
    data = read_yaml(path)
    name = path.stem
    if name in data and isinstance(data[name], dict):
        return name, dict(data[name])
    if len(data) == 1 and isinstance(next(iter(data.values())), dict):
        key = next(iter(data))
        return key, dict(data[key])
    return name, data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value), the value read as a YAML scalar or list."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.replace("-", "_").split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied."""
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def normalise_keys(data: Any) -> Any:
    """Replace ``-`` by ``_`` in mapping keys, recursively (the seed does this)."""
    if isinstance(data, dict):
        return {str(k).replace("-", "_"): normalise_keys(v) for k, v in data.items()}
    if isinstance(data, list):
        return [normalise_keys(v) for v in data]
    return data
