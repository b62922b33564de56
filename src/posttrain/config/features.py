"""Every config key honest: refuse the features posttrain does not have yet, and name once the
knobs that have no effect on this hardware.

The status of each key is stored on its field (:mod:`posttrain.config.fields`; the table is
``docs/config_reference.md``). Two entry points, both part of the one config check that
``posttrain plan`` and ``posttrain train`` run (:func:`posttrain.config.check.check_run_config`),
after the seed's rules:

* :func:`check_features` raises one :class:`~posttrain.errors.ConfigError` naming every refused key
  that is active, one per line: ``section.key=value: <why>; <what to do>``.
* :func:`startup_warnings` returns the ignored keys the config sets, as one message.

Which keys count as set: a refused key when its value is active (by default: not its default); an
ignored key when the config writes it (in a section or in a model yaml it pulls) with an active
value. ``generate_config`` is only looked at for the stages that roll out (not dpo or sft). Keys
honoured on the megatron backend (``Rule.megatron``) are skipped there, and the vLLM keys
(``Rule.vllm``) with ``rl_config.rollout_engine: vllm`` (passed to vLLM, :mod:`posttrain.config.vllm`,
or refused by the compatibility table, :mod:`posttrain.config.compat`). Combinations of features
(a key refused with another, on a backend, engine, placement or device) are that table's rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from posttrain.config.backend import resolve_backend
from posttrain.config.compat import no_effect, setup_of
from posttrain.config.fields import Rule, Status, field_rule, fmt_value
from posttrain.config.loader import normalise_keys
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig, role_sources
from posttrain.config.stages import stage_named
from posttrain.device import device_type
from posttrain.errors import ConfigError

# critic_config keys the critic does not read on its own: it follows the actor's value.
CRITIC_FOLLOWS_ACTOR = {
    "save_interval": "is saved at the actor's iterations (actor_config.save_interval)",
    **dict.fromkeys(("no_save_optim", "no_save_rng"),
                    "is saved inside the actor's checkpoints (<save>/iter_*/critic/) unless critic_config.save "
                    "names its own directory"),
    **dict.fromkeys(("stage", "global_batch_size", "train_iters", "seq_length", "data_path", "seed",
                     "tokenizer_name_or_path", "prompt_type", "bf16"),
                    "runs in the actor's loop, with the actor's data, tokenizer and precision"),
}


@dataclass(frozen=True)
class Key:
    """One key of one section of a loaded config, with its rule."""

    section: str  # where the value was written: megatron_training, actor_config, model.<name>, rl_config, ...
    name: str
    value: Any
    default: Any
    rule: Rule
    written: bool  # the config writes it (vs a schema default)

    @property
    def label(self) -> str:
        return f"{self.section}.{self.name}"


def check_features(cfg: RunConfig, device_type: str | None = None, backend: str | None = None) -> None:
    """Raise one :class:`ConfigError` naming every refused key that ``cfg`` sets, one per line (see
    the module doc).

    ``device_type`` ("cpu" or "cuda") decides the keys refused on one kind of device only (the
    offload keys, which have no effect on a CPU); default: ``rl_config.device`` resolved.
    ``backend`` ("hf" or "megatron"; default: :func:`posttrain.config.backend.resolve_backend`):
    the keys honoured on the megatron backend are not refused there."""
    device = device_type or _device(cfg)
    backend = backend or _backend(cfg)

    def refused(k: Key, block: list[Key]) -> bool:
        return (k.rule.status is Status.REFUSED and device in k.rule.devices and (k.written or not k.rule.explicit)
                and _is_set(k, block, cfg, device)
                and not _megatron_honours(k, block, backend, device) and not _vllm_checks(k, cfg))

    messages: list[str] = []
    for name, block in _blocks(cfg):
        groups: set[str] = set()
        for key in block:
            if not refused(key, block) or key.rule.group in groups:
                continue
            keys = [key]
            if key.rule.group:
                groups.add(key.rule.group)
                keys = [k for k in block if k.rule.group == key.rule.group and refused(k, block)]
            messages.append(_refusal(keys))
        if name == "critic_config":
            try:
                _check_critic(cfg)
            except ConfigError as err:
                messages.append(str(err))
    if messages:
        raise ConfigError("\n".join(messages))


def startup_warnings(cfg: RunConfig, device_type: str, backend: str | None = None) -> list[str]:
    """The keys ``cfg`` sets that have no effect on ``device_type`` ("cpu" or "cuda") with ``backend``
    (default: resolved from ``cfg``), as one message (an empty list when there are none)."""
    backend = backend or _backend(cfg)
    labels: list[str] = []
    for _, block in _blocks(cfg):
        for key in block:
            rule = key.rule
            if _megatron_honours(key, block, backend, device_type) or _vllm_checks(key, cfg):
                continue
            if rule.status is Status.IGNORED:
                inert = device_type in rule.devices and (key.written or not rule.explicit)
            elif rule.status is Status.REFUSED:
                inert = device_type not in rule.devices
            else:
                continue
            if inert and _is_set(key, block, cfg, device_type) and key.label not in labels:
                labels.append(key.label)
    labels += [label for label in no_effect(cfg, setup_of(cfg, device_type, backend)) if label not in labels]
    if not labels:
        return []
    return [f"keys with no effect on this hardware ({device_type}): {', '.join(labels)}"]


# ---- the keys of a config, section by section ---------------------------------------------------
def _blocks(cfg: RunConfig) -> list[tuple[str, list[Key]]]:
    """The sections in the order they are checked; the Megatron roles carry where each key was written."""
    blocks = [("actor_config", _role(cfg, "actor_config", cfg.actor)),
              ("rl_config", _section(cfg, ("rl_config",), cfg.rl))]
    if _rolls_out(cfg):
        blocks.append(("generate_config", _section(cfg, ("generate_config",), cfg.generate)))
        blocks.append(("sampling_config", _section(cfg, ("generate_config", "sampling_config"),
                                                   cfg.generate.sampling_config)))
    if cfg.critic is not None:
        blocks.append(("critic_config", _role(cfg, "critic_config", cfg.critic)))
    if cfg.reward is not None:  # its own reading rules: posttrain.config.reward_model
        blocks.append(("reward_config", _role(cfg, "reward_config", cfg.reward)))
    blocks.append(("profiler_config", _section(cfg, ("profiler_config", "integrated"), cfg.profiler)))
    blocks.append(("msprobe_config", _section(cfg, ("msprobe_config",), cfg.msprobe)))
    return blocks


def _raw(cfg: RunConfig, path: tuple[str, ...]) -> dict[str, Any]:
    node: Any = cfg.raw
    for part in path:
        node = normalise_keys(node.get(part)) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _section(cfg: RunConfig, path: tuple[str, ...], obj: BaseModel) -> list[Key]:
    cls, written, label = type(obj), _raw(cfg, path), ".".join(path)
    return [Key(label, name, getattr(obj, name), field.default, field_rule(cls, name), name in written)
            for name, field in cls.model_fields.items()]


def _role_sources(cfg: RunConfig, role_section: str) -> dict[str, str]:
    """key -> the section that wrote it last, in the seed's merge order (run.py ``_merge_role``)."""
    return role_sources(cfg.raw, cfg.models, role_section)


def _role(cfg: RunConfig, role_section: str, obj: MegatronConfig) -> list[Key]:
    sources = _role_sources(cfg, role_section)
    fallback = "megatron_training" if role_section == "actor_config" else role_section
    return [Key(sources.get(name, fallback), name, getattr(obj, name), field.default,
                field_rule(MegatronConfig, name), name in sources)
            for name, field in MegatronConfig.model_fields.items()]


def _rolls_out(cfg: RunConfig) -> bool:
    try:
        return stage_named(cfg.actor.stage or cfg.actor.algorithm).on_policy
    except ConfigError:
        return True


def _backend(cfg: RunConfig) -> str:
    return resolve_backend(cfg)[0]


def _device(cfg: RunConfig) -> str:
    return device_type(cfg.rl.device)


# ---- predicates and messages ------------------------------------------------------------------
def _is_set(key: Key, block: list[Key], cfg: RunConfig, device: str) -> bool:
    rule = key.rule
    if rule.switch is not None:
        switch = next(k for k in block if k.name == rule.switch)
        if not switch.rule.is_active(switch.value, switch.default, device):
            return False
    if rule.active == "actor_devices":  # separated mode: a group of its own (posttrain.config.separated, compat.py)
        count = getattr(key.value, "num_npus", None)
        return cfg.rl.use_integrated_worker and count is not None and count != (cfg.rl.actor_resource.num_npus or 1)
    return rule.is_active(key.value, key.default, device)


def _megatron_honours(key: Key, block: list[Key], backend: str, device: str) -> bool:
    """``Rule.megatron``: the key is honoured on the megatron backend (with ``megatron_with`` active)."""
    rule = key.rule
    if backend != "megatron" or not rule.megatron:
        return False
    if rule.megatron_with is None:
        return True
    other = next(k for k in block if k.name == rule.megatron_with)
    return other.rule.is_active(other.value, other.default, device)


def _vllm_checks(key: Key, cfg: RunConfig) -> bool:
    """``Rule.vllm``: with ``rollout_engine: vllm`` the key is passed to vLLM (:mod:`posttrain.config.vllm`)
    or refused by the compatibility table (:mod:`posttrain.config.compat`), not here."""
    return key.rule.vllm and cfg.rl.rollout_engine == "vllm"


def _refusal(keys: list[Key]) -> str:
    settings = ", ".join(f"{k.label}={fmt_value(k.value)}" for k in keys)
    todos = list(dict.fromkeys(k.rule.default_todo(k.default) for k in keys))
    if len(keys) == 1 or len(todos) == 1:
        todo = todos[0]
        if len(keys) > 1:
            todo = re.sub(r"\bremove the key\b", "remove the keys", todo).replace("set it to ", "set them to ")
    else:
        defaults = ", ".join(f"{k.name}: {fmt_value(k.default)}" for k in keys)
        todo = f"remove these keys or set them to their defaults ({defaults})"
    return f"{settings}: {keys[0].rule.why}; {todo}"


def _check_critic(cfg: RunConfig) -> None:
    """critic_config keys that the critic takes from the actor must not differ from the actor's."""
    for name in _raw(cfg, ("critic_config",)):
        why = CRITIC_FOLLOWS_ACTOR.get(name)
        mine, actor = getattr(cfg.critic, name, None), getattr(cfg.actor, name, None)
        if name in ("no_save_optim", "no_save_rng") and cfg.critic.save and cfg.critic.save != cfg.actor.save:
            continue  # its own checkpoints: its own flags
        if why is not None and mine != actor:
            raise ConfigError(f"critic_config.{name}={fmt_value(mine)}: the critic {why}, so it takes the actor's "
                              f"value; remove the key or give it the actor's value ({fmt_value(actor)})")
