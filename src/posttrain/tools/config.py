"""Reading a tools file (``rl_config.tool_config_path``) into tool objects.

The format is the one verl and MindSpeed-RL use for ``configs/tools/*.yaml``::

    tools:
      - class_name: code_interpreter          # a registered tool, or package.module.ClassName
        config: {timeout_s: 5, memory_mb: 512} # keyword arguments of the class (optional)
        tool_schema:                           # what the model is shown (OpenAI function schema)
          type: function
          function:
            name: code_interpreter
            description: A tool for executing code.
            parameters:
              type: object
              properties: {code: {type: string, description: The code to execute.}}
              required: [code]

:func:`load_tools` checks everything before building a tool, and every problem is a
:class:`ConfigError` naming the file and the key path (``x.yaml: tools[1].tool_schema.function.name:
missing; ...``) and saying what to do. Paths inside ``config`` stay as written: a tool whose
``__init__`` takes ``base_dir`` receives the file's folder and resolves them against it.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import ConfigError
from posttrain.tools.base import TOOLS, Tool, ToolConfigError, schema_problem

TOP_KEYS = ("tools",)
TOOL_KEYS = ("class_name", "config", "tool_schema")
_RESERVED = ("schema",)  # given from tool_schema, never from config


def load_tools(path: str | Path) -> dict[str, Tool]:
    """The tools of a tools file, by the name the model calls them (``tool_schema.function.name``)."""
    path = Path(path)
    where = str(path)
    data = _read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        got = "empty" if data is None else f"a {type(data).__name__}" if not isinstance(data, dict) else (
            "a mapping without tools" if "tools" not in data else f"a mapping whose tools is a "
            f"{type(data['tools']).__name__}")
        raise ConfigError(f"{where}: the file is {got}; it must be a mapping with a `tools:` list, "
                          f"one entry (class_name, config, tool_schema) per tool")
    _refuse_unknown(f"{where}: ", data, TOP_KEYS, "top-level key", "the only one is `tools` (a list); remove or "
                    "move the others")
    if not data["tools"]:
        raise ConfigError(f"{where}: tools: the list is empty; give at least one tool, or do not set "
                          f"rl_config.tool_config_path")

    entries = [_check_entry(where, i, entry) for i, entry in enumerate(data["tools"])]
    seen: dict[str, int] = {}
    for i, (_, _, schema) in enumerate(entries):
        name = schema["function"]["name"]
        if name in seen:
            raise ConfigError(f"{where}: tools[{i}].tool_schema.function.name: {name!r} is also the name of "
                              f"tools[{seen[name]}]; each tool needs its own name")
        seen[name] = i

    tools: dict[str, Tool] = {}
    for i, (class_name, config, schema) in enumerate(entries):
        cls = _resolve_class(where, i, class_name)
        kwargs = _check_config(where, i, class_name, cls, config)
        if "base_dir" in _init_parameters(cls):
            kwargs.setdefault("base_dir", path.parent)
        try:
            tool = cls(schema, **kwargs)
        except ToolConfigError as e:
            raise ConfigError(f"{where}: tools[{i}].config.{e}") from e
        except ConfigError as e:
            raise ConfigError(f"{where}: tools[{i}] ({class_name}): {e}") from e
        except Exception as e:
            raise ConfigError(f"{where}: tools[{i}].config: {class_name} refused its config "
                              f"({type(e).__name__}: {e}); fix the value") from e
        tools[tool.name] = tool
    return tools


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        what = "is a folder, not a file" if path.exists() else "does not exist"
        raise ConfigError(f"{path}: the tools file {what}; check rl_config.tool_config_path (a relative "
                          f"path is read from the current directory, {Path.cwd()})")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: YAML syntax error{at}: {problem}; fix the file (indent with spaces, "
                          f"quote strings that hold ': ' or start with a special character)") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); save the file as UTF-8") from e


def _check_entry(where: str, i: int, entry: Any) -> tuple[str, dict, dict]:
    """``(class_name, config, tool_schema)`` of ``tools[i]``, checked."""
    at = f"{where}: tools[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}: is a {type(entry).__name__}; each tool is a mapping with class_name, "
                          f"config (optional) and tool_schema")
    _refuse_unknown(f"{at}: ", entry, TOOL_KEYS, "key", f"a tool has {', '.join(TOOL_KEYS)} (settings of the tool "
                    "go under config)")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        got = "missing" if class_name is None else f"is {class_name!r}"
        raise ConfigError(f"{at}.class_name: {got}; give a registered tool ({', '.join(TOOLS.names())}) "
                          f"or the dotted path of a Tool subclass (package.module.ClassName)")
    config = entry.get("config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f"{at}.config: is a {type(config).__name__}; give a mapping of keyword "
                          f"arguments of {class_name} (or leave it out)")
    if "tool_schema" not in entry:
        raise ConfigError(f"{at}.tool_schema: missing; give the function schema the model is shown "
                          f"(type: function, function: {{name, description, parameters}})")
    schema = entry["tool_schema"]
    problem = schema_problem(schema)
    if problem is not None:
        key, what = problem
        raise ConfigError(f"{at}.tool_schema{'.' + key if key else ''}: {what}")
    return class_name.strip(), config, schema


def _resolve_class(where: str, i: int, class_name: str) -> type[Tool]:
    at = f"{where}: tools[{i}].class_name"
    if "." in class_name and class_name not in TOOLS:
        module_name, _, attr = class_name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(f"{at}: cannot import module {module_name!r} for {class_name!r} "
                              f"({type(e).__name__}: {e}); install the package or add its folder to "
                              f"PYTHONPATH") from e
        if not hasattr(module, attr):
            raise ConfigError(f"{at}: module {module_name!r} has no {attr!r}; check the spelling of "
                              f"{class_name!r}")
        cls = getattr(module, attr)
    else:
        try:
            cls = TOOLS.get(class_name)
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ConfigError(f"{at}: {class_name!r} is {cls!r}, not a subclass of posttrain.tools.base.Tool; "
                          f"point class_name at a Tool subclass")
    return cls


def _init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword-passable parameters of ``cls.__init__`` after ``self`` and ``schema``; a ``**kw``
    parameter is included under its own name (kind VAR_KEYWORD)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return {p.name: p for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD)}


def _check_config(where: str, i: int, class_name: str, cls: type, config: dict) -> dict[str, Any]:
    at = f"{where}: tools[{i}].config"
    params = _init_parameters(cls)
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = [name for name, p in params.items() if p.kind is not p.VAR_KEYWORD]
    known = ", ".join(k for k in accepted if k not in _RESERVED) or "none"
    reserved = [k for k in config if k in _RESERVED]
    if reserved:
        raise ConfigError(f"{at}.{reserved[0]}: set by tool_schema, not config; move it there")
    unknown = [k for k in config if k not in accepted and not open_ended]
    if unknown:
        raise ConfigError(f"{at}: {_names(unknown)}: not accepted by {class_name} ({_qualname(cls)}); "
                          f"its config keys are: {known}")
    missing = [name for name, p in params.items() if p.default is p.empty and p.kind is not p.VAR_KEYWORD
               and name not in config and name != "base_dir"]
    if missing:
        raise ConfigError(f"{at}.{missing[0]}: missing; {class_name} needs it (its config keys are: {known})")
    return dict(config)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _refuse_unknown(at: str, data: dict, known: tuple[str, ...], what: str, hint: str) -> None:
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ConfigError(f"{at}{_names(unknown)}: unknown {what}{'s' if len(unknown) > 1 else ''}; {hint}")


def _names(keys: list) -> str:
    return ", ".join(str(k) for k in keys)
