"""The tools file (posttrain.tools.config.load_tools): the shipped files load, every bad input is a
ConfigError naming the file and the key path, and a user's own tool loads by registered name or by
dotted path. Also Tool.check_arguments."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.tools.base import TOOLS, Tool, register_tool
from posttrain.tools.config import load_tools
from posttrain.tools.sandbox import detect_sandbox

REPO = Path(__file__).resolve().parents[3]
TOOLS_DIR = REPO / "configs" / "tools"


def _can_sandbox() -> bool:
    try:
        detect_sandbox()
        return True
    except ConfigError:
        return False


def _schema(name: str = "echo", properties: dict | None = None, required: list | None = None) -> dict:
    props = {"text": {"type": "string"}} if properties is None else properties
    return {"type": "function", "function": {
        "name": name, "description": "Echoes.",
        "parameters": {"type": "object", "properties": props, "required": ["text"] if required is None else required}}}


class Echo(Tool):
    """A test tool with one config key."""

    def __init__(self, schema: dict, *, prefix: str = ""):
        super().__init__(schema)
        self.prefix = prefix

    def execute(self, arguments: dict) -> str:
        return self.prefix + arguments["text"]


class NotATool:
    def __init__(self, schema, **kw):
        pass


ECHO_SCHEMA_YAML = """\
    tool_schema:
      type: function
      function:
        name: echo
        description: Echoes its text.
        parameters: {type: object, properties: {text: {type: string}}, required: [text]}
"""


def _write(tmp_path: Path, text: str, name: str = "tools.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def echo_registered():
    """Echo registered as "test_echo" for one test."""
    register_tool("test_echo", overwrite=True)(Echo)
    yield
    TOOLS._entries.pop("test_echo", None)


# --------------------------------------------------------------------------------------------------
# the shipped files


def test_the_shipped_search_file_loads_and_finds_its_passage():
    tools = load_tools(TOOLS_DIR / "search.yaml")
    assert list(tools) == ["search"]
    search = tools["search"]
    assert search.schema["function"]["parameters"]["required"] == ["query"]
    assert search.corpus_path == TOOLS_DIR / "search_corpus.jsonl"  # relative to the yaml's folder
    assert len(search.passages) >= 15
    assert search.execute({"query": "highest mountain"}).startswith("Doc 1 (Title: Mount Everest):")


def test_the_shipped_retool_file_loads_where_the_host_can_sandbox():
    if not _can_sandbox():
        with pytest.raises(ConfigError, match="retool.yaml: tools\\[0\\] \\(code_interpreter\\): .*sandbox"):
            load_tools(TOOLS_DIR / "retool.yaml")
        return
    tools = load_tools(TOOLS_DIR / "retool.yaml")
    tool = tools["code_interpreter"]
    assert tool.schema["function"]["description"] == "A tool for executing code."
    assert (tool.timeout_s, tool.memory_mb, tool.max_output_bytes) == (5.0, 512, 16384)


def test_the_builtin_tools_are_registered():
    assert {"code_interpreter", "search"} <= set(TOOLS.names())


# --------------------------------------------------------------------------------------------------
# user tools


def test_a_user_tool_registered_by_decorator(tmp_path, echo_registered):
    path = _write(tmp_path, 'tools:\n  - class_name: test_echo\n    config: {prefix: ">> "}\n' + ECHO_SCHEMA_YAML)
    tools = load_tools(path)
    assert type(tools["echo"]) is Echo and tools["echo"].execute({"text": "hi"}) == ">> hi"


def test_a_user_tool_by_dotted_path(tmp_path, monkeypatch):
    package = tmp_path / "mytools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shout.py").write_text(textwrap.dedent("""\
        from posttrain.tools.base import Tool

        class Shout(Tool):
            def execute(self, arguments):
                return arguments["text"].upper() + self.config.get("end", "")
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, 'tools:\n  - class_name: mytools.shout.Shout\n    config: {end: "!"}\n' + ECHO_SCHEMA_YAML)
    tool = load_tools(path)["echo"]
    assert type(tool).__name__ == "Shout" and tool.execute({"text": "hi"}) == "HI!"
    sys.modules.pop("mytools.shout", None)
    sys.modules.pop("mytools", None)


def test_a_tool_taking_base_dir_gets_the_files_folder(tmp_path):
    sub = tmp_path / "cfg"
    sub.mkdir()
    (sub / "corpus.jsonl").write_text('{"title": "Owls", "contents": "Owls hunt at night."}\n')
    path = _write(sub, """\
        tools:
          - class_name: search
            config: {corpus_path: corpus.jsonl, top_k: 1}
            tool_schema:
              type: function
              function:
                name: lookup
                parameters: {type: object, properties: {query: {type: string}}, required: [query]}
        """)
    tool = load_tools(path)["lookup"]
    assert tool.corpus_path == sub / "corpus.jsonl" and tool.top_k == 1
    assert "Owls hunt" in tool.execute({"query": "owls"})


def test_register_tool_refuses_a_clash_and_a_non_tool(echo_registered):
    class Other(Tool):
        pass

    with pytest.raises(ConfigError, match="'test_echo' is already registered by .*Echo"):
        register_tool("test_echo")(Other)
    register_tool("test_echo")(Echo)  # the same class again is fine
    with pytest.raises(TypeError, match="Tool subclass"):
        register_tool("test_not_a_tool")(NotATool)


# --------------------------------------------------------------------------------------------------
# bad input: each names the file, the key path and what to do

GOOD_ENTRY = """\
  - class_name: search
    config: {corpus_path: c.jsonl}
    tool_schema:
      type: function
      function:
        name: search
        parameters: {type: object, properties: {query: {type: string}}, required: [query]}
"""

BAD = {
    "yaml-syntax": ("tools:\n  - class_name: search\n   config: [\n", r"YAML syntax error at line \d+"),
    "not-a-mapping": ("- a\n- b\n", r"the file is a list; it must be a mapping with a `tools:` list"),
    "no-tools": ("other: 1\n", r"a mapping without tools; it must be a mapping with a `tools:` list"),
    "tools-not-list": ("tools: {a: 1}\n", r"whose tools is a dict"),
    "empty-tools": ("tools: []\n", r"tools: the list is empty"),
    "unknown-top-key": ("tools:\n" + GOOD_ENTRY + "extra: 1\n", r"extra: unknown top-level key; the only one is `tools`"),
    "entry-not-mapping": ("tools:\n" + GOOD_ENTRY + "  - search\n", r"tools\[1\]: is a str; each tool is a mapping"),
    "unknown-tool-key": ("tools:\n  - class_name: search\n    params: {}\n    tool_schema: {}\n",
                         r"tools\[0\]: params: unknown key; a tool has class_name, config, tool_schema"),
    "no-class-name": ("tools:\n  - tool_schema: {}\n", r"tools\[0\]\.class_name: missing; give a registered tool \(.*search"),
    "no-schema": ("tools:\n  - class_name: search\n", r"tools\[0\]\.tool_schema: missing"),
    "config-not-mapping": ("tools:\n  - class_name: search\n    config: [1]\n    tool_schema: {}\n",
                           r"tools\[0\]\.config: is a list; give a mapping"),
    "schema-type": ("tools:\n" + GOOD_ENTRY.replace("type: function", "type: tool"),
                    r"tools\[0\]\.tool_schema\.type: is 'tool'; it must be \"function\""),
    "schema-no-name": ("tools:\n" + GOOD_ENTRY + GOOD_ENTRY.replace("        name: search", "        description: x"),
                       r"tools\[1\]\.tool_schema\.function\.name: missing; give the tool's name"),
    "schema-empty-name": ("tools:\n" + GOOD_ENTRY.replace("        name: search", "        name: ''"),
                          r"tools\[0\]\.tool_schema\.function\.name: is ''"),
    "schema-params": ("tools:\n" + GOOD_ENTRY.replace("{type: object, properties", "{type: string, properties"),
                      r"tools\[0\]\.tool_schema\.function\.parameters: has type 'string'; it must be an object schema"),
    "schema-no-params": ("tools:\n" + GOOD_ENTRY.replace("        parameters:", "        x:"),
                         r"tools\[0\]\.tool_schema\.function\.parameters: missing"),
    "schema-prop-type": ("tools:\n" + GOOD_ENTRY.replace("{query: {type: string}}", "{query: {type: str}}"),
                         r"tools\[0\]\.tool_schema\.function\.parameters\.properties\.query\.type: is 'str'; use one of"),
    "schema-required": ("tools:\n" + GOOD_ENTRY.replace("required: [query]", "required: [q]"),
                        r"tools\[0\]\.tool_schema\.function\.parameters\.required: names 'q', not in properties"),
    "duplicate-name": ("tools:\n" + GOOD_ENTRY + GOOD_ENTRY,
                       r"tools\[1\]\.tool_schema\.function\.name: 'search' is also the name of tools\[0\]"),
    "unknown-class": ("tools:\n" + GOOD_ENTRY.replace("class_name: search", "class_name: serach"),
                      r"tools\[0\]\.class_name: Unknown tool 'serach'; known: .*code_interpreter, .*search"),
    "dotted-not-importable": ("tools:\n" + GOOD_ENTRY.replace("class_name: search", "class_name: no_such_pkg.tools.X"),
                              r"tools\[0\]\.class_name: cannot import module 'no_such_pkg\.tools'.*PYTHONPATH"),
    "dotted-no-attr": ("tools:\n" + GOOD_ENTRY.replace("class_name: search", "class_name: posttrain.tools.base.Nope"),
                       r"tools\[0\]\.class_name: module 'posttrain\.tools\.base' has no 'Nope'"),
    "dotted-not-a-tool": ("tools:\n" + GOOD_ENTRY.replace("class_name: search", "class_name: pathlib.Path"),
                          r"tools\[0\]\.class_name: 'pathlib\.Path' is .*, not a subclass of posttrain\.tools\.base\.Tool"),
    "config-unknown-key": ("tools:\n" + GOOD_ENTRY.replace("{corpus_path: c.jsonl}", "{corpus_path: c.jsonl, topk: 2}"),
                           r"tools\[0\]\.config: topk: not accepted by search .*its config keys are: corpus_path, top_k, base_dir"),
    "config-missing-key": ("tools:\n" + GOOD_ENTRY.replace("{corpus_path: c.jsonl}", "{top_k: 2}"),
                           r"tools\[0\]\.config\.corpus_path: missing; search needs it"),
    "config-schema-key": ("tools:\n" + GOOD_ENTRY.replace("{corpus_path: c.jsonl}", "{corpus_path: c.jsonl, schema: {}}"),
                          r"tools\[0\]\.config\.schema: set by tool_schema, not config"),
    "config-bad-value": ("tools:\n" + GOOD_ENTRY.replace("{corpus_path: c.jsonl}", "{corpus_path: c.jsonl, top_k: 0}"),
                         r"tools\[0\]\.config: search refused its config \(ValueError: top_k must be a positive"),
    "corpus-missing": ("tools:\n" + GOOD_ENTRY.replace("c.jsonl", "missing.jsonl"),
                       r"tools\[0\] \(search\): .*missing\.jsonl: the search corpus does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_file_and_key(tmp_path, case):
    text, message = BAD[case]
    (tmp_path / "c.jsonl").write_text('{"contents": "a passage"}\n')
    path = _write(tmp_path, text, name=f"{case}.yaml")
    with pytest.raises(ConfigError) as err:
        load_tools(path)
    assert str(err.value).startswith(f"{path}: "), str(err.value)
    assert err.match(message), str(err.value)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: the tools file does not exist; check rl_config\.tool_config_path"):
        load_tools(tmp_path / "nope.yaml")


def test_a_yaml_error_gives_the_line(tmp_path):
    path = _write(tmp_path, "tools:\n  - class_name: search\n    config: {a: 1\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line 4"):
        load_tools(path)


# --------------------------------------------------------------------------------------------------
# Tool itself


def test_tool_name_and_schema_validation():
    assert Echo(_schema("say")).name == "say"
    with pytest.raises(ConfigError, match="tool schema: function.name: missing"):
        Echo({"type": "function", "function": {"parameters": {"type": "object"}}})


@pytest.mark.parametrize("arguments,message", [
    ({"text": "x"}, None),
    ({"text": "x", "n": 2, "f": 1.5, "b": True, "xs": [1], "o": {}}, None),
    ({"text": "x", "f": 2}, None),  # an integer is a number
    ({}, "echo needs the argument 'text'; its arguments are: text (string), n (integer, optional)"),
    ({"text": "x", "k": 1}, "echo has no argument 'k'"),
    ({"text": 3}, "the argument 'text' of echo must be a string, not an integer"),
    ({"text": "x", "n": "2"}, "the argument 'n' of echo must be an integer, not a string"),
    ({"text": "x", "n": True}, "the argument 'n' of echo must be an integer, not a boolean"),
    ({"text": "x", "n": 1.5}, "must be an integer, not a number"),
    ({"text": "x", "b": 1}, "the argument 'b' of echo must be a boolean, not an integer"),
    ({"text": "x", "xs": "a"}, "the argument 'xs' of echo must be an array"),
    ({"text": "x", "o": []}, "the argument 'o' of echo must be an object, not an array"),
    ({"text": "x", "maybe": None}, None),
    ({"text": "x", "maybe": 1.0}, "must be a string or null"),
    ("text", "must be a JSON object, not str"),
])
def test_check_arguments(arguments, message):
    props = {"text": {"type": "string"}, "n": {"type": "integer"}, "f": {"type": "number"},
             "b": {"type": "boolean"}, "xs": {"type": "array"}, "o": {"type": "object"},
             "maybe": {"type": ["string", "null"]}}
    tool = Echo(_schema(properties=props))
    got = tool.check_arguments(arguments)
    if message is None:
        assert got is None
    else:
        assert got is not None and message in got, got


def test_additional_properties_allows_unknown_arguments():
    schema = _schema()
    schema["function"]["parameters"]["additionalProperties"] = True
    assert Echo(schema).check_arguments({"text": "x", "extra": 1}) is None


CODE_ENTRY = GOOD_ENTRY.replace("class_name: search", "class_name: code_interpreter").replace(
    "{corpus_path: c.jsonl}", "{CONFIG}").replace("name: search", "name: code_interpreter").replace(
    "{query: {type: string}}", "{code: {type: string}}").replace("required: [query]", "required: [code]")


@pytest.mark.parametrize("config,key,message", [
    ("timeout_s: .nan", "timeout_s", "must be a finite number of seconds > 0 and <= 3600, not nan"),
    ("timeout_s: .inf", "timeout_s", "must be a finite number of seconds > 0 and <= 3600, not inf"),
    ("cpu_s: .inf", "cpu_s", "must be a finite number of seconds > 0 and <= 3600, not inf"),
    ("memory_mb: 1", "memory_mb", "must be a whole number from 32 to 1073741824, not 1"),
    ("max_output_bytes: 1000000000000", "max_output_bytes", "must be a whole number from 1 to 16777216, not 1000000000000"),
    ("memory_mb: 256.0", "memory_mb", "must be a whole number from 32 to 1073741824, not 256.0"),
    ("timeout_s: 86400", "timeout_s", "must be a finite number of seconds > 0 and <= 3600, not 86400"),
], ids=["T1-nan", "T2-inf", "T3-cpu-inf", "T4-memory-1", "T6-output-1e12", "SB60-float", "SB61-a-day"])
def test_code_interpreter_limits_out_of_range_name_file_and_key(tmp_path, config, key, message):
    """Probes T1-T4, T6 (accepted: no wall clock, or every call failing), SB60 (the message named two
    keys at once) and SB61 (a day per call, while the runner gave up after 60 s)."""
    path = _write(tmp_path, "tools:\n" + CODE_ENTRY.replace("{CONFIG}", "{" + config + "}"))
    with pytest.raises(ConfigError) as err:
        load_tools(path)
    assert str(err.value) == f"{path}: tools[0].config.{key}: {message}"
