"""The multi-turn keys of ``rl_config`` (tools, the parser, the limits) and ``async_engine``.

``multi_turn_enable: true`` makes the native engine run tool turns (:mod:`posttrain.rollout.multi_turn`)
with the tools of ``tool_config_path`` (:mod:`posttrain.tools.config`). ``async_engine: true`` is
the seed's streaming engine; here it means per-request admission in the native engine: each sample
row ends, pauses for its tools and resumes on its own (the multi-turn decode loop, with or without
tools). The seed's rule 21 lives in :mod:`posttrain.config.validate`; the stages, engines and
features multi-turn and ``async_engine`` do not run with are rows of the compatibility table
(:mod:`posttrain.config.compat`), and the values each key takes are declared on its field.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError
from posttrain.paths import configs_dir, shipped_file

# the keys that mean something only with multi_turn_enable: true, and their seed defaults
SUB_KEYS = {"tool_config_path": None, "max_tool_calls": 0, "max_parallel_calls": 0, "max_total_response_length": 0,
            "max_tool_response_length": 0, "tool_response_truncate_side": None, "tool_parser_format": None}
DEFAULT_PARSER = "hermes"


def tool_config_file(path: str) -> Path:
    """``rl_config.tool_config_path`` as a file: as given (from the current directory), else a
    ``configs/...`` path in the configs folders (so ``configs/tools/retool.yaml`` works from anywhere)."""
    found = shipped_file(path)
    if found.is_file():
        return found
    raise ConfigError(f"rl_config.tool_config_path={path}: no such file (looked in {Path.cwd()} and "
                      f"{configs_dir()}); point it at a tools yaml such as configs/tools/retool.yaml")


def check_multi_turn(cfg: RunConfig) -> None:
    """Raise ConfigError on a multi-turn setting that cannot run: a multi-turn key without
    ``multi_turn_enable``; with it, no tools file, no tool calls, no template for tool outputs."""
    rl = cfg.rl
    if not rl.multi_turn_enable:
        stray = [k for k, default in SUB_KEYS.items() if getattr(rl, k) != default]
        if stray:
            raise ConfigError(f"rl_config.{stray[0]} is read only with multi_turn_enable: true; set "
                              f"multi_turn_enable: true (and async_engine: true) or remove the key")
        return
    if not rl.tool_config_path:
        raise ConfigError("rl_config.tool_config_path is not set: multi-turn rollout needs a tools file, e.g. "
                          "configs/tools/retool.yaml (docs/tools.md)")
    if rl.max_tool_calls < 1:
        raise ConfigError(f"rl_config.max_tool_calls={rl.max_tool_calls}: must be >= 1 with multi_turn_enable "
                          f"(the most tool calls of one sample)")
    from posttrain.data.templates import HF_CHAT_TEMPLATE  # lazy: multi-turn only; ~25 ms off posttrain plan
    from posttrain.tools.parsers import TOOL_PARSERS

    TOOL_PARSERS.get(rl.tool_parser_format or DEFAULT_PARSER)
    prompt_type = cfg.actor.prompt_type
    if not prompt_type or prompt_type == HF_CHAT_TEMPLATE:
        raise ConfigError(f"actor_config.prompt_type={prompt_type!r}: multi-turn rollout wraps tool outputs with a "
                          f"templates.json template's format_observation; name one, e.g. qwen_retool")
    load_tool_file(rl.tool_config_path)


def load_tool_file(path: str) -> dict:
    """The tools of ``rl_config.tool_config_path`` (name -> Tool), built."""
    from posttrain.tools.config import load_tools  # lazy: as in check_multi_turn

    return load_tools(tool_config_file(path))
