"""The tool base class and the tool registry.

A tool is a :class:`Tool` subclass: it is built from its OpenAI-style function schema (what the
chat template shows the model) plus keyword arguments (the ``config`` of its entry in the tools
file, see :mod:`posttrain.tools.config`), and :meth:`Tool.execute` turns the model's arguments
into the text the model reads back::

    from posttrain.tools.base import Tool, ToolError, register_tool

    @register_tool("word_count")
    class WordCount(Tool):
        def __init__(self, schema: dict, *, max_chars: int = 10_000):
            super().__init__(schema)
            self.max_chars = max_chars

        def execute(self, arguments: dict) -> str:
            text = arguments["text"]
            if len(text) > self.max_chars:
                raise ToolError(f"the text is longer than {self.max_chars} characters")
            return str(len(text.split()))

Select it with ``class_name: word_count`` in the tools file (the module that defines it must be
imported first), or give its dotted path, ``class_name: my_package.tools.WordCount``, which
needs no registration. ``TOOLS.get(name)`` looks a registered class up; the built-in tools
(``code_interpreter``, ``search``) are registered on the first lookup.

Imports only the standard library and :mod:`posttrain.registry`.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from posttrain.errors import ConfigError
from posttrain.registry import Registry

_BUILTIN_MODULES = (
    "posttrain.tools.code_interpreter",
    "posttrain.tools.search",
)

TOOLS = Registry(
    "tool", key="class_name in the tools yaml (rl_config.tool_config_path)", modules=_BUILTIN_MODULES,
    hint="A tool of your own is a posttrain.tools.base.Tool subclass: register it with @register_tool "
         "in a module that is imported before the tools file is read, or give its dotted path "
         "(package.module.ClassName) as class_name.")

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}
"""The JSON-schema primitive types that :meth:`Tool.check_arguments` checks, and their Python types."""


class ToolConfigError(ConfigError):
    """A tool refuses a value of its config: ``key`` names it, and the message says what it must be.
    :func:`posttrain.tools.config.load_tools` reports it as ``<file>: tools[i].config.<key>: ...``."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class ToolError(Exception):
    """Raised by :meth:`Tool.execute` for a problem the model caused (a bad value, an empty query):
    the model is shown ``[error: <message>]``, without the exception's type."""


class Tool:
    """The base class of a tool.

    ``schema`` is the OpenAI-style function schema
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` (validated here:
    a bad one raises :class:`ConfigError`); ``config`` holds the remaining keyword arguments of a
    subclass that does not take them itself. Subclasses implement :meth:`execute`, and take their
    settings as keyword arguments with defaults (the tools file's ``config`` is checked against the
    ``__init__`` signature). A subclass whose ``__init__`` has a ``base_dir`` parameter gets the
    tools file's folder there, to resolve relative paths in its config.

    :meth:`execute` may be called from several threads at once: keep it free of shared mutable state
    (or lock it).
    """

    def __init__(self, schema: dict, **config: Any):
        problem = schema_problem(schema)
        if problem is not None:
            where, what = problem
            raise ConfigError(f"tool schema: {where}: {what}")
        self.schema: dict = schema
        self.config: dict[str, Any] = dict(config)

    @property
    def name(self) -> str:
        """The name the model calls the tool by (the schema's ``function.name``)."""
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments (an ``object`` schema)."""
        return self.schema["function"]["parameters"]

    @property
    def call_seconds(self) -> float | None:
        """How long one call may take by the tool's own bound (None: it has none). The runner waits
        at least this long before it abandons a call, so a tool is never abandoned while it keeps
        to its own limit."""
        return None

    def check_arguments(self, arguments: dict) -> str | None:
        """An error message for the model when ``arguments`` do not fit the schema; None when fine.

        Checked: required arguments are present, no argument is unknown (unless the schema sets
        ``additionalProperties``), and each argument has its declared primitive type (``string``,
        ``integer``, ``number``, ``boolean``, ``array``, ``object``, ``null``, or a list of them).
        Nested schemas (items, nested properties) are not checked.
        """
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, not {type(arguments).__name__}"
        params = self.parameters
        properties = params.get("properties") or {}
        usage = self._usage()
        missing = [k for k in params.get("required") or () if k not in arguments]
        if missing:
            return f"{self.name} needs the argument{_s(missing)} {_names(missing)}; {usage}"
        if not params.get("additionalProperties", False):
            unknown = [k for k in arguments if k not in properties]
            if unknown:
                return f"{self.name} has no argument{_s(unknown)} {_names(unknown)}; {usage}"
        for key, value in arguments.items():
            declared = (properties.get(key) or {}).get("type")
            if declared is None:
                continue
            names = [declared] if isinstance(declared, str) else list(declared)
            if not any(_is_type(value, t) for t in names):
                want = " or ".join(names)
                return (f"the argument {key!r} of {self.name} must be {_article(want)} {want}, "
                        f"not {_json_type(value)}")
        return None

    def execute(self, arguments: dict) -> str:
        """Run the tool on arguments that passed :meth:`check_arguments`; returns what the model reads.

        Raise :class:`ToolError` for a problem the model caused; any other exception is reported to
        the model as the tool having raised it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement execute(arguments) -> str")

    def _usage(self) -> str:
        properties = self.parameters.get("properties") or {}
        required = set(self.parameters.get("required") or ())
        if not properties:
            return "it takes no arguments"
        parts = [f"{k} ({(p or {}).get('type', 'any')}{'' if k in required else ', optional'})"
                 for k, p in properties.items()]
        return "its arguments are: " + ", ".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def schema_problem(schema: Any) -> tuple[str, str] | None:
    """The first problem of a tool schema as ``(key path, what is wrong and what to do)``; None if fine.

    The key path is relative to the schema, e.g. ``("function.name", "missing; ...")``.
    """
    if not isinstance(schema, dict):
        return "", f"must be a mapping with type: function and a function, not {_json_type(schema)}"
    if schema.get("type") != "function":
        got = "missing" if "type" not in schema else f"is {schema['type']!r}"
        return "type", f"{got}; it must be \"function\" (an OpenAI-style function schema)"
    function = schema.get("function")
    if not isinstance(function, dict):
        got = "missing" if function is None else f"is {_json_type(function)}"
        return "function", f"{got}; give a mapping with name, description and parameters"
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "missing" if name is None else f"is {name!r}"
        return "function.name", f"{got}; give the tool's name (a non-empty string the model calls it by)"
    if "description" in function and not isinstance(function["description"], str):
        return "function.description", "must be a string (tell the model what the tool does)"
    params = function.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        got = ("missing" if params is None else
               f"has type {params.get('type')!r}" if isinstance(params, dict) else f"is {_json_type(params)}")
        return "function.parameters", (f"{got}; it must be an object schema: {{type: object, properties: "
                                       f"{{...}}, required: [...]}} (properties: {{}} for no arguments)")
    properties = params.get("properties", {})
    if not isinstance(properties, dict):
        return "function.parameters.properties", "must be a mapping from argument name to its schema"
    for key, prop in properties.items():
        where = f"function.parameters.properties.{key}"
        if not isinstance(prop, dict):
            return where, "must be a mapping such as {type: string, description: ...}"
        declared = prop.get("type")
        names = [declared] if isinstance(declared, str) else declared
        if declared is not None and (not isinstance(names, list) or any(t not in JSON_TYPES for t in names)):
            return f"{where}.type", f"is {declared!r}; use one of {', '.join(JSON_TYPES)}"
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return "function.parameters.required", "must be a list of argument names"
    undeclared = [k for k in required if k not in properties]
    if undeclared:
        return "function.parameters.required", f"names {_names(undeclared)}, not in properties; declare them there"
    return None


ToolClass = TypeVar("ToolClass", bound=type)


def register_tool(name: str, *, overwrite: bool = False) -> Callable[[ToolClass], ToolClass]:
    """Decorator: register a :class:`Tool` subclass as ``name`` (the ``class_name`` of the tools file).

    Registering a second, different class under a taken name raises :class:`ConfigError` unless
    ``overwrite``; the same class re-imported is fine.
    """

    def deco(cls: ToolClass) -> ToolClass:
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise TypeError(f"@register_tool({name!r}) decorates a Tool subclass, not {cls!r}")
        return TOOLS.add_unique(name, cls, replace=overwrite)

    return deco


def _is_type(value: Any, name: str) -> bool:
    if name not in JSON_TYPES:  # schema_problem refuses these; a hand-built schema may still hold one
        return True
    if isinstance(value, bool) and name != "boolean":  # bool is an int subclass in Python
        return False
    return isinstance(value, JSON_TYPES[name])


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name):
            return {"null": "null", "integer": "an integer", "array": "an array",
                    "object": "an object"}.get(name, f"a {name}")
    return type(value).__name__


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _s(items: list) -> str:
    return "s" if len(items) > 1 else ""


def _names(items: list) -> str:
    return ", ".join(repr(k) for k in items)
