"""Reading config files: YAML with clear errors, ``defaults: - model: [...]``, dotted overrides.

This module works on plain dicts; :mod:`posttrain.config.schema` turns them into typed sections.
It is shared by training configs (``configs/*.yaml``) and dataset configs
(``configs/datasets/*.yaml``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import ConfigError
from posttrain.paths import configs_dir


# The most values a YAML document may expand to (aliases counted each time they are used): a few
# hundred bytes of nested aliases ("billion laughs") would otherwise expand to gigabytes.
MAX_YAML_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class Origins:
    """Where the keys of a config came from: a line of its YAML file or a command-line override.

    ``lines`` maps key paths (``("megatron_training", "global_batch_size")``) to 1-based lines;
    ``overrides`` maps the key paths that overrides set to the override's text."""

    path: Path | None = None
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    overrides: dict[tuple[str, ...], str] = field(default_factory=dict)

    def of(self, *keys: str) -> str:
        """``override 'a.b=1'``, ``file.yaml line 9``, ``file.yaml`` or "" (a config built in Python)."""
        keys = tuple(keys)
        for n in range(len(keys), 0, -1):  # an override that set this key or a section above it wins
            if keys[:n] in self.overrides:
                return f"override '{self.overrides[keys[:n]]}'"
        line = self.lines.get(keys)
        if line is None:
            deeper = [text for path, text in self.overrides.items() if path[:len(keys)] == keys]
            if deeper:  # the section exists only because an override wrote a key into it
                return f"override '{deeper[0]}'"
        if self.path is None:
            return ""
        return f"{self.path} line {line}" if line is not None else str(self.path)

    def prefix(self, *keys: str) -> str:
        """:meth:`of` followed by ": " (empty when the origin is unknown)."""
        where = self.of(*keys)
        return f"{where}: " if where else ""


class _YAMLLimit(yaml.MarkedYAMLError):
    """A document that is well-formed YAML but that posttrain refuses (duplicates, alias bombs)."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader; :func:`_load` checks the composed document before building it."""


def _key_name(node: yaml.Node) -> str | None:
    if isinstance(node, yaml.ScalarNode):
        return str(node.value)
    return None


def _check_document(root: yaml.Node, sections: bool = True) -> dict[tuple[str, ...], int]:
    """Refuse duplicate keys and documents that expand to more than :data:`MAX_YAML_NODES` values
    (or to a cycle); return the line of every mapping key by its path (the first time it is met).
    ``sections``: the top-level keys are a config's sections (a file, not an override's value)."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...] | None) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _YAMLLimit(problem="an alias refers to a node that contains it (a recursive structure)",
                             problem_mark=node.start_mark)
        active.add(key)
        size = 1
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                size += walk(child, None)
                if size > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for k, v in node.value:
                name = _key_name(k)
                if name is not None and k.tag != _MERGE_TAG:
                    norm = name.replace("-", "_")
                    if norm in seen:
                        first = seen[norm]
                        what = (f"duplicate key '{name}' in {'.'.join(path)}" if path else
                                f"duplicate section '{name}'" if path is not None else f"duplicate key '{name}'")
                        raise _YAMLLimit(
                            context=what,
                            context_mark=first.start_mark, problem=f"'{name}' is written twice",
                            problem_mark=k.start_mark)
                    seen[norm] = k
                child_path = path + (name.replace("-", "_"),) if path is not None and name is not None else None
                if child_path is not None:
                    lines.setdefault(child_path, k.start_mark.line + 1)
                size += walk(k, None) + walk(v, child_path)
                if size > MAX_YAML_NODES:
                    break
        active.discard(key)
        if size > MAX_YAML_NODES:
            raise _YAMLLimit(problem=f"the document expands to more than {MAX_YAML_NODES:,} values (aliases "
                                     f"repeated inside aliases); posttrain refuses to load it",
                             problem_mark=node.start_mark)
        sizes[key] = size
        return size

    walk(root, () if sections else None)
    return lines


def _load(text: str, sections: bool = True) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Parse one YAML document safely: (data, the line of each mapping key by its path)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines = _check_document(node, sections)
        return loader.construct_document(node), lines
    finally:
        loader.dispose()


def _open_quote(text: str, before: yaml.Mark | None) -> yaml.Token | None:
    """The last quoted string that spans several lines and starts before ``before``: the usual
    cause of a YAML error far below an unclosed quote."""
    found = None
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if before is not None and token.start_mark.index >= before.index:
                break
            if (isinstance(token, yaml.ScalarToken) and token.style in ('"', "'")
                    and token.end_mark.line > token.start_mark.line):
                found = token
    except yaml.YAMLError:
        pass
    return found


def _yaml_error(path: Path, text: str, err: yaml.MarkedYAMLError) -> ConfigError:
    if isinstance(err, _YAMLLimit):
        if err.context_mark is not None:  # a duplicate key: both lines
            return ConfigError(f"{path}: {err.context} at lines {err.context_mark.line + 1} and "
                               f"{err.problem_mark.line + 1}; YAML would keep only the last one silently. "
                               f"Remove one of them (or merge the two)")
        return ConfigError(f"{path}: {err.problem} (at line {err.problem_mark.line + 1})")
    if (isinstance(err, yaml.scanner.ScannerError) and err.context_mark is not None
            and "quoted scalar" in (err.context or "")):
        m = err.context_mark
        return ConfigError(f"{path}: malformed YAML at line {m.line + 1}, column {m.column + 1}: the quoted string "
                           f"that starts there is never closed; add the closing quote")
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    message = f"{path}: malformed YAML at {where}: {err.problem or err}"
    quote = _open_quote(text, mark)
    if quote is not None:
        m = quote.start_mark
        message += (f". The quoted string that starts at line {m.line + 1}, column {m.column + 1} runs on to line "
                    f"{quote.end_mark.line + 1}: is its closing quote missing?")
    elif isinstance(err, yaml.parser.ParserError):
        message += (". The error may start earlier: look for an unclosed quote or bracket above this line")
    return ConfigError(message)


def read_yaml_with_lines(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    """:func:`read_yaml` and the line of every mapping key by its path (see :class:`Origins`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start} (line "
                          f"{line}); save the file as UTF-8") from None
    try:
        data, lines = _load(text)
    except yaml.MarkedYAMLError as err:
        raise _yaml_error(path, text, err) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: the YAML is nested too deeply") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data, lines


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse one YAML file into a dict; errors name the file, line and column. Duplicate keys, text
    that is not UTF-8 and documents whose aliases expand past :data:`MAX_YAML_NODES` values are errors."""
    return read_yaml_with_lines(path)[0]


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
        value = _load(raw, sections=False)[0] if raw != "" else ""
    except _YAMLLimit as err:
        if err.context_mark is not None:
            raise ConfigError(f"override '{text}': {err.context}; give each key once") from None
        raise ConfigError(f"override '{text}': {err.problem}") from None
    except RecursionError:
        raise ConfigError(f"override '{text}': the value is nested too deeply") from None
    except yaml.YAMLError:
        value = raw
    return key.replace("-", "_").split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str], origins: Origins | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied (recorded in ``origins``)."""
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        if origins is not None:
            origins.overrides[tuple(parts)] = text
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
