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
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from posttrain.config.fields import RANGE_ERRORS, check_known_keys, check_known_names, range_refusal
from posttrain.config.loader import (Origins, apply_overrides, load_model_yaml, normalise_keys,
                                     read_yaml_with_lines, resolve_config_file)
from posttrain.config.megatron import MegatronConfig, ignored_keys_in
from posttrain.config.sections import GenerateConfig, MsprobeConfig, ProfilerConfig, Resource, RLConfig, SamplingConfig
from posttrain.config.stages import stage_named
from posttrain.errors import ConfigError
from posttrain.paths import configs_dir

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
    origins: Origins = field(repr=False, default_factory=Origins)  # the file line or override of each key

    @property
    def stage(self) -> str:
        """The stage's canonical name: grpo, dapo, ppo, dpo or sft (:mod:`posttrain.config.stages`)."""
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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _type_error(section: str, err: ValidationError, label: Callable[[str], str] | None = None,
                cls: type[BaseModel] | None = None) -> ConfigError:
    """One line per pydantic error; ``label(key)`` says where a key was written (``where: section.key``).
    A value outside the range that ``cls`` declares for it reads ``section.key=value: must be ...``
    (:func:`~posttrain.config.fields.range_refusal`)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        if loc:
            head = label(str(e["loc"][0])) if label else f"{section}.{e['loc'][0]}"
            rest = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"][1:])
            refusal = range_refusal(cls, e["loc"], got) if cls is not None and e["type"] in RANGE_ERRORS else None
            if refusal is not None:
                lines.append(f"{_without_own_override(head, rest)}{rest}{refusal}")
            else:
                lines.append(f"{head}{rest}: {e['msg']} (got {_shown(got)})")
        else:
            lines.append(f"{label('') if label else section}: {e['msg']}")
    return ConfigError("\n".join(lines))


def _without_own_override(head: str, rest: str = "") -> str:
    """``override 'a.b.c=1': a.b`` (``rest`` ``.c``) -> ``a.b``: the message repeats that key and value."""
    if head.startswith("override '"):
        text, _, key = head[len("override '"):].partition("': ")
        if text.startswith((f"{key}=", f"{key}{rest}=")):
            return key
    return head


def build_section(section: str, data: dict[str, Any] | None, cls: type[BaseModel],
                  label: Callable[[str], str] | None = None, origins: Origins | None = None) -> Any:
    """Validate one section's dict against its class: unknown keys and wrong types are errors.
    ``label(key)`` names where a key was written (``"file.yaml line 9: megatron_training.lr"``);
    ``label("")`` the section itself. ``origins`` places unknown keys (a file line or an override)."""
    data = normalise_keys(data or {})
    if not isinstance(data, dict):
        where = label("") if label else section
        raise ConfigError(f"{where}: must be a mapping of keys, not {type(data).__name__}")
    parts = tuple(section.split("."))

    def where(*keys: str) -> Callable[[str], str]:
        return lambda key: origins.prefix(*parts, *keys, key) if origins is not None else ""

    check_known_keys(section, data, cls, where())
    for key, sub_cls in _NESTED.get(cls, {}).items():
        if isinstance(data.get(key), dict):
            check_known_keys(f"{section}.{key}", data[key], sub_cls, where(key))
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise _type_error(section, err, label, cls) from None


def _nested() -> dict[type, dict[str, type]]:
    resources = {k: Resource for k in ("actor_resource", "reference_resource", "reward_resource",
                                       "critic_resource", "vit_resource")}
    return {RLConfig: resources, GenerateConfig: {"sampling_config": SamplingConfig}}


_NESTED = _nested()
INTEGRATED_MODE_KEYS = ["ref_model_load_path"]  # rl_config.integrated_mode_config (seed_system.md 3.2)
PROFILER_ROLES = ["integrated"]  # profiler_config: only the integrated role is read (seed_system.md 3.5)


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {_shown(value)}"


def _check_shapes(data: dict[str, Any], origins: Origins) -> None:
    """Sections are mappings, ``defaults`` a list, ``model`` a mapping of mappings; profiler_config
    holds only ``integrated`` and ``rl_config.integrated_mode_config`` only its known keys."""
    for section in TOP_LEVEL[2:]:
        value = data.get(section)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{origins.prefix(section)}{section} must be a mapping of keys (key: value lines "
                              f"indented under '{section}:'), not {_kind(value)}")
    defaults = data.get("defaults")
    if defaults is not None and not isinstance(defaults, list):
        raise ConfigError(f"{origins.prefix('defaults')}defaults must be a list like '- model: [name]', not "
                          f"{_kind(defaults)}")
    models = data.get("model")
    if models is not None:
        if not isinstance(models, dict):
            raise ConfigError(f"{origins.prefix('model')}model must be a mapping of model names to their "
                              f"architecture keys ('model: {{name: {{num_layers: ...}}}}'), not {_kind(models)}")
        for name, keys in models.items():
            if not isinstance(keys, dict):
                raise ConfigError(f"{origins.prefix('model', str(name))}model.{name} must be a mapping of "
                                  f"architecture keys (num_layers, hidden_size, ...), not {_kind(keys)}")
            check_known_keys(f"model.{name}", normalise_keys(keys), MegatronConfig,
                             lambda key, name=str(name): origins.prefix("model", name, key))
    profiler = normalise_keys(data.get("profiler_config") or {})
    check_known_names("profiler_config", profiler, PROFILER_ROLES, lambda key: origins.prefix("profiler_config", key))
    rl = normalise_keys(data.get("rl_config") or {})
    integrated = rl.get("integrated_mode_config")
    if isinstance(integrated, dict):
        check_known_names("rl_config.integrated_mode_config", integrated, INTEGRATED_MODE_KEYS,
                          lambda key: origins.prefix("rl_config", "integrated_mode_config", key))


def _load_defaults(data: dict[str, Any], model_dir: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Path]]:
    """The models of ``model:`` and of the model yamls ``defaults`` names, and each model yaml's file."""
    models: dict[str, dict[str, Any]] = {str(k): normalise_keys(v) for k, v in (data.get("model") or {}).items()}
    files: dict[str, Path] = {}
    for entry in data.get("defaults") or []:
        if not isinstance(entry, dict) or set(entry) != {"model"}:
            raise ConfigError(f"defaults: entries must look like '- model: [name]', got {entry!r}")
        names = entry["model"]
        for name in names if isinstance(names, list) else [names]:
            if not isinstance(name, (str, int, float)):
                raise ConfigError(f"defaults: a model name must be a name, got {_kind(name)}")
            key, keys = load_model_yaml(str(name), model_dir)
            path = Path(str(name)) if Path(str(name)).suffix else model_dir / f"{name}.yaml"
            keys = normalise_keys(keys)
            if not isinstance(keys, dict):
                raise ConfigError(f"{path}: must be a mapping of architecture keys, not {_kind(keys)}")
            check_known_keys(f"model.{key}", keys, MegatronConfig, f"{path}: ")
            models[key] = keys
            files[key] = path
    return models, files


def role_sources(raw: dict[str, Any], models: dict[str, dict], role_section: str) -> dict[str, str]:
    """key -> the section that wrote it last in the seed's merge order (:func:`_merge_role`):
    ``megatron_training``, ``role_section`` or ``model.<name>``."""
    sources: dict[str, str] = {}
    for section in ("megatron_training", role_section):
        data = normalise_keys(raw.get(section)) if isinstance(raw.get(section), dict) else {}
        model = data.get("model")
        if model is not None and model in models:
            sources.update(dict.fromkeys(models[model], f"model.{model}"))
        sources.update(dict.fromkeys(data, section))
    return sources


def _merge_role(models: dict[str, dict], *sections: dict[str, Any] | None) -> dict[str, Any]:
    """The seed's merge: each section applies its ``model:`` architecture, then its own keys."""
    merged: dict[str, Any] = {}
    for sec in sections:
        sec = normalise_keys(sec or {})
        name = sec.get("model")
        if name is not None:
            if not isinstance(name, str) or name not in models:
                known = ", ".join(models) or "none (add '- model: [name]' to defaults)"
                raise ConfigError(f"model '{name}' is not loaded; models loaded by defaults: {known}")
            merged.update(models[name])
        merged.update(sec)
    return merged


def load_run_config(name: str, config_path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    path = resolve_config_file(name, config_path)
    data, lines = read_yaml_with_lines(path)
    return run_config_from_dict(data, name=path.stem, path=path, overrides=list(overrides), lines=lines)


def run_config_from_dict(data: dict[str, Any], name: str = "config", path: Path | None = None,
                         overrides: list[str] = (), lines: dict[tuple[str, ...], int] | None = None) -> RunConfig:
    """Merge, override and check ``data`` (a parsed YAML file at ``path``, whose keys are on ``lines``)."""
    origins = Origins(path=path, lines=dict(lines or {}))
    data = apply_overrides(data, list(overrides), origins)
    for key in data:
        if key not in TOP_LEVEL:
            where = origins.of(str(key)) or str(name)
            raise ConfigError(f"{where}: unknown section '{key}'. Known sections: {', '.join(TOP_LEVEL)}")
    _check_shapes(data, origins)
    model_dir = (path.parent / "model") if path is not None else None
    if model_dir is None or not model_dir.is_dir():
        model_dir = configs_dir() / "model"
    models, model_files = _load_defaults(data, model_dir)
    for section in MEGATRON_SECTIONS:
        if data.get(section) is not None:
            check_known_keys(section, normalise_keys(data[section]), MegatronConfig,
                             lambda key, section=section: origins.prefix(section, key))

    def labeller(role_section: str) -> Callable[[str], str]:
        sources = role_sources(data, models, role_section)

        def label(key: str) -> str:
            if not key:
                return f"{origins.prefix(role_section)}{role_section}"
            section = sources.get(key, role_section)
            if section.startswith("model.") and section[6:] in model_files:
                return f"{model_files[section[6:]]}: {section}.{key}"
            return f"{origins.prefix(*section.split('.'), key)}{section}.{key}"
        return label

    def plain(section: str) -> Callable[[str], str]:
        parts = section.split(".")
        return lambda key: (f"{origins.prefix(*parts, key)}{section}.{key}" if key
                            else f"{origins.prefix(*parts)}{section}")

    train = data.get("megatron_training")
    actor_dict = _merge_role(models, train, data.get("actor_config"))
    roles = {"actor": build_section("actor_config", actor_dict, MegatronConfig, labeller("actor_config"))}
    for role in ("ref", "reward", "critic"):
        section = data.get(f"{role}_config")
        roles[role] = (build_section(f"{role}_config", _merge_role(models, train, section), MegatronConfig,
                                     labeller(f"{role}_config"))
                       if section is not None else None)
    ignored = ignored_keys_in(actor_dict)
    profiler = normalise_keys(data.get("profiler_config") or {})
    return RunConfig(
        name=name, path=path, models=models,
        actor=roles["actor"], ref=roles["ref"], reward=roles["reward"], critic=roles["critic"],
        rl=build_section("rl_config", data.get("rl_config"), RLConfig, plain("rl_config"), origins),
        generate=build_section("generate_config", data.get("generate_config"), GenerateConfig,
                               plain("generate_config"), origins),
        profiler=build_section("profiler_config.integrated", profiler.get("integrated"), ProfilerConfig,
                               plain("profiler_config.integrated"), origins),
        msprobe=build_section("msprobe_config", data.get("msprobe_config"), MsprobeConfig, plain("msprobe_config"),
                              origins),
        raw=data, ignored_keys=ignored, origins=origins,
    )
