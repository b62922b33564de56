"""Every config key the docs name (``section.key`` in README.md and docs/*.md) exists in the schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("**/*.md"))]
SECTIONS = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config", "rl_config",
            "generate_config", "profiler_config", "msprobe_config")
# the keys of the mapping-valued keys (checked by their own code, not the schema)
DICT_KEYS = {"integrated_mode_config": ("ref_model_load_path",),
             "env_config": ("type", "id", "args", "limit", "resets", "max_turns")}  # posttrain.envs.config.KEYS
KEY = re.compile(r"\b(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def schema_has(section: str, path: list[str]) -> bool:
    from pydantic import BaseModel

    from posttrain.config.megatron import MegatronConfig
    from posttrain.config.sections import GenerateConfig, MsprobeConfig, ProfilerConfig, RLConfig

    cls = {"rl_config": RLConfig, "generate_config": GenerateConfig, "msprobe_config": MsprobeConfig}.get(
        section, MegatronConfig)
    if section == "profiler_config":
        cls, path = ProfilerConfig, path[1:] if path[:1] == ["integrated"] else path
    for i, name in enumerate(path):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or name not in cls.model_fields:
            return i > 0 and name in DICT_KEYS.get(path[i - 1], ())
        annotation = cls.model_fields[name].annotation
        args = getattr(annotation, "__args__", ())
        cls = next((a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return True


def mentions():
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in KEY.finditer(line):
                path = match.group(2).strip(".").split(".")
                if path[-1] in ("yaml", "md", "py"):  # a file name, not a key
                    continue
                yield pytest.param(match.group(1), path, id=f"{doc.relative_to(ROOT)}:{lineno}:{match.group(0)}")


@pytest.mark.parametrize("section,path", list(mentions()))
def test_documented_key_exists(section, path):
    assert schema_has(section, path), f"{section}.{'.'.join(path)} is not a key of the config schema"
