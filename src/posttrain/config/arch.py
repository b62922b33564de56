"""The actor's model architecture as the config describes it (:func:`model_arch`): read by the plan
(sizes, memory) and by the megatron backend's checks (heads and layers divisible by TP and PP)."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.fields import ARCH_WHY, field_rule
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig, role_sources
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch, arch_from_hf_config, arch_from_model_yaml

# the architecture keys: they describe the model built from the config's sizes (posttrain.models.arch)
BUILD_KEYS = tuple(name for name in MegatronConfig.model_fields
                   if field_rule(MegatronConfig, name).why == ARCH_WHY)
SIZES = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size")


def model_arch(cfg: RunConfig, hf_config: str | None = None) -> ModelArch | None:
    """The actor's architecture: an explicit HF config, else the model yaml, else ``load``'s (or the
    tokenizer's) ``config.json``; None when none of them describes the model. A model-yaml key the
    model cannot carry is a ConfigError naming it (:mod:`posttrain.models.arch_keys`), and so is a key
    that only describes a model to build when the config gives no sizes."""
    if hf_config:
        return arch_from_hf_config(hf_config)
    a = cfg.actor
    if all(getattr(a, key) for key in SIZES):
        return arch_from_model_yaml(a.model or "actor", a.model_dump())
    _check_no_build_keys(cfg)
    for candidate in (a.load, a.pretrained_checkpoint, a.tokenizer_name_or_path):
        if candidate and (Path(candidate) / "config.json").is_file():
            try:
                return arch_from_hf_config(candidate)
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                continue  # not a model's config.json: no estimate (loading the model reports it)
    return None


def _check_no_build_keys(cfg: RunConfig) -> None:
    """Without the model's sizes, the architecture comes from a ``config.json``: the architecture keys
    (MLA, DeepSeek's experts and router, RoPE scaling, a size) would change nothing."""
    sources = role_sources(cfg.raw, cfg.models, "actor_config")
    written = [f"{sources[key]}.{key}" for key in BUILD_KEYS if key in sources]
    if written:
        missing = ", ".join(key for key in SIZES if not getattr(cfg.actor, key))
        where = cfg.actor.load or cfg.actor.tokenizer_name_or_path
        raise ConfigError(f"{', '.join(written)}: describe the model that posttrain init-model builds and posttrain "
                          f"plan sizes, and this config does not give the model's sizes ({missing}); the run takes "
                          f"its architecture from the model it loads ({where or 'load'}/config.json), so these keys "
                          f"would change nothing. Remove them, or give the sizes (a model yaml, model: <name>)")
