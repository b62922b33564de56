"""A whole training config: the seed's YAML sections, typed and merged per role.

``load_run_config("r1_zero_qwen25_7b", overrides=["rl_config.n_samples_per_prompt=8"])`` reads
``configs/r1_zero_qwen25_7b.yaml``, pulls the model yamls named in ``defaults``, applies the
overrides, checks every key, and builds one :class:`MegatronConfig` per role as the seed does
(``actor = {**megatron_training, **actor_config}``, each section taking its ``model:``
architecture first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from posttrain.config.fields import check_known_keys
from posttrain.config.loader import (apply_overrides, load_model_yaml, normalise_keys, read_yaml,
                                     resolve_config_file)
from posttrain.config.megatron import MegatronConfig, ignored_keys_in
from posttrain.config.sections import GenerateConfig, MsprobeConfig, ProfilerConfig, RLConfig
from posttrain.errors import ConfigError

MEGATRON_SECTIONS = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config")
TOP_LEVEL = ("defaults", "model", *MEGATRON_SECTIONS, "rl_config", "generate_config", "profiler_config",
             "msprobe_config")


@dataclass
class RunConfig:
    """Typed view of one training YAML after merging, overrides and key checks."""

    name: str
    path: Path | None
    models: dict[str, dict[str, Any]]
    actor: MegatronConfig
    ref: MegatronConfig | None
    reward: MegatronConfig | None
    critic: MegatronConfig | None
    rl: RLConfig
    generate: GenerateConfig
    profiler: ProfilerConfig
    msprobe: MsprobeConfig
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    ignored_keys: list[str] = field(default_factory=list)

    @property
    def stage(self) -> str:
        """The stage's canonical name: grpo, dapo, ppo, dpo or sft (:mod:`posttrain.config.stages`)."""
        from posttrain.config.stages import stage_named

        return stage_named(self.actor.stage or self.actor.algorithm).name

    def explicitly_set(self, *section_key: str) -> bool:
        """Whether a key was written in the YAML or the overrides (not just a schema default),
        e.g. ``cfg.explicitly_set("generate_config", "max_num_seqs")``."""
        node = self.raw
        for part in section_key:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True


def _type_error(section: str, err: ValidationError) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        lines.append(f"{section}.{loc}: {e['msg']} (got {got!r})" if loc else f"{section}: {e['msg']}")
    return ConfigError("; ".join(lines))


def build_section(section: str, data: dict[str, Any] | None, cls: type[BaseModel]) -> Any:
    """Validate one section's dict against its class: unknown keys and wrong types are errors."""
    data = normalise_keys(data or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, not {type(data).__name__}")
    check_known_keys(section, data, cls)
    for key, sub_cls in _NESTED.get(cls, {}).items():
        if isinstance(data.get(key), dict):
            check_known_keys(f"{section}.{key}", data[key], sub_cls)
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise _type_error(section, err) from None


def _nested() -> dict[type, dict[str, type]]:
    from posttrain.config.sections import Resource, SamplingConfig

    resources = {k: Resource for k in ("actor_resource", "reference_resource", "reward_resource",
                                       "critic_resource", "vit_resource")}
    return {RLConfig: resources, GenerateConfig: {"sampling_config": SamplingConfig}}


_NESTED = _nested()


def _load_defaults(data: dict[str, Any], model_dir: Path) -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = dict(data.get("model") or {})
    for entry in data.get("defaults") or []:
        if not isinstance(entry, dict) or set(entry) != {"model"}:
            raise ConfigError(f"defaults: entries must look like '- model: [name]', got {entry!r}")
        names = entry["model"]
        for name in names if isinstance(names, list) else [names]:
            key, keys = load_model_yaml(str(name), model_dir)
            models[key] = normalise_keys(keys)
    return models


def _merge_role(models: dict[str, dict], *sections: dict[str, Any] | None) -> dict[str, Any]:
    """The seed's merge: each section applies its ``model:`` architecture, then its own keys."""
    merged: dict[str, Any] = {}
    for sec in sections:
        sec = normalise_keys(sec or {})
        name = sec.get("model")
        if name is not None:
            if name not in models:
                known = ", ".join(models) or "none (add '- model: [name]' to defaults)"
                raise ConfigError(f"model '{name}' is not loaded; models loaded by defaults: {known}")
            merged.update(models[name])
        merged.update(sec)
    return merged


def load_run_config(name: str, config_path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    path = resolve_config_file(name, config_path)
    data = read_yaml(path)
    return run_config_from_dict(data, name=path.stem, path=path, overrides=list(overrides))


def run_config_from_dict(data: dict[str, Any], name: str = "config", path: Path | None = None,
                         overrides: list[str] = ()) -> RunConfig:
    data = apply_overrides(data, list(overrides))
    for key in data:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{path or name}: unknown section '{key}'. Known sections: {', '.join(TOP_LEVEL)}")
    model_dir = (path.parent / "model") if path is not None else None
    if model_dir is None or not model_dir.is_dir():
        from posttrain.paths import configs_dir

        model_dir = configs_dir() / "model"
    models = _load_defaults(data, model_dir)
    for section in MEGATRON_SECTIONS:
        if data.get(section) is not None:
            check_known_keys(section, normalise_keys(data[section]), MegatronConfig)

    train = data.get("megatron_training")
    actor_dict = _merge_role(models, train, data.get("actor_config"))
    roles = {"actor": build_section("actor_config", actor_dict, MegatronConfig)}
    for role in ("ref", "reward", "critic"):
        section = data.get(f"{role}_config")
        roles[role] = (build_section(f"{role}_config", _merge_role(models, train, section), MegatronConfig)
                       if section is not None else None)
    ignored = ignored_keys_in(actor_dict)
    profiler = data.get("profiler_config") or {}
    return RunConfig(
        name=name, path=path, models=models,
        actor=roles["actor"], ref=roles["ref"], reward=roles["reward"], critic=roles["critic"],
        rl=build_section("rl_config", data.get("rl_config"), RLConfig),
        generate=build_section("generate_config", data.get("generate_config"), GenerateConfig),
        profiler=build_section("profiler_config.integrated", profiler.get("integrated"), ProfilerConfig),
        msprobe=build_section("msprobe_config", data.get("msprobe_config"), MsprobeConfig),
        raw=data, ignored_keys=ignored,
    )
