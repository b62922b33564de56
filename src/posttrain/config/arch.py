"""The actor's model architecture as the config describes it (:func:`model_arch`): read by the plan
(sizes, memory) and by the megatron backend's checks (heads and layers divisible by TP and PP)."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.run import RunConfig
from posttrain.models.arch import ModelArch, arch_from_hf_config, arch_from_model_yaml


def model_arch(cfg: RunConfig, hf_config: str | None = None) -> ModelArch | None:
    """The actor's architecture: an explicit HF config, else the model yaml, else ``load``'s (or the
    tokenizer's) ``config.json``; None when none of them describes the model."""
    if hf_config:
        return arch_from_hf_config(hf_config)
    a = cfg.actor
    if a.num_layers and a.hidden_size and a.num_attention_heads and a.padded_vocab_size:
        return arch_from_model_yaml(a.model or "actor", a.model_dump())
    for candidate in (a.load, a.pretrained_checkpoint, a.tokenizer_name_or_path):
        if candidate and (Path(candidate) / "config.json").is_file():
            try:
                return arch_from_hf_config(candidate)
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                continue  # not a model's config.json: no estimate (loading the model reports it)
    return None
