"""The vision tower of a vision-language model (Qwen2.5-VL): its sizes, parameter count and HF keys.

A model yaml describes the tower under one posttrain key, ``vision_tower`` (a mapping of the HF
``vision_config`` names: ``depth``, ``hidden_size``, ``num_heads``, ``intermediate_size``,
``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``, ``window_size``,
``fullatt_block_indexes``); ``hf_model_type: qwen2_5_vl`` says the model is a VLM. No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.errors import ConfigError

VLM_TYPES = ("qwen2_5_vl",)
NOT_BUILT = {model_type: "this vision-language model is not built yet (its vision tower also feeds several decoder "
                         "layers, deepstack, which the multimodal forward does not pass)"
             for model_type in ("qwen3_vl", "qwen3_vl_moe")}
# the vision special tokens a VLM's tokenizer adds, and the config key of each one's id
VISION_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                 "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}


@dataclass(frozen=True)
class VisionTower:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the language model's hidden size (the merger's output)
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()

    def num_params(self) -> int:
        """Patch embedding (a bias-free Conv3d), ``depth`` blocks (two RMSNorms, QKV and output
        projections with bias, a gated MLP with bias) and the patch merger (RMSNorm, two linears)."""
        h, f = self.hidden_size, self.intermediate_size
        patch = self.in_channels * self.temporal_patch_size * self.patch_size ** 2 * h
        block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * f + f) + (f * h + h)
        merged = h * self.spatial_merge_size ** 2
        merger = h + (merged * merged + merged) + (merged * self.out_hidden_size + self.out_hidden_size)
        return patch + self.depth * block + merger

    def to_hf_config(self) -> dict[str, Any]:
        return {"depth": self.depth, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "intermediate_size": self.intermediate_size, "out_hidden_size": self.out_hidden_size,
                "patch_size": self.patch_size, "spatial_merge_size": self.spatial_merge_size,
                "temporal_patch_size": self.temporal_patch_size, "in_channels": self.in_channels,
                "window_size": self.window_size, "fullatt_block_indexes": list(self.fullatt_block_indexes),
                "hidden_act": "silu"}


_REQUIRED = ("depth", "hidden_size", "num_heads", "intermediate_size")
_OPTIONAL = ("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "window_size")


def vision_tower(name: str, keys: Mapping[str, Any], model_type: str, hidden_size: int) -> VisionTower | None:
    """The ``vision_tower`` of a model yaml (None for a text model); checked against ``hf_model_type``."""
    tower = keys.get("vision_tower")
    if model_type in NOT_BUILT:
        raise ConfigError(f"model '{name}': hf_model_type={model_type}: {NOT_BUILT[model_type]}; use "
                          f"hf_model_type: qwen2_5_vl")
    if tower is None:
        if model_type in VLM_TYPES:
            raise ConfigError(f"model '{name}': hf_model_type={model_type} is a vision-language model; give its "
                              f"vision_tower sizes ({', '.join(_REQUIRED)})")
        return None
    if model_type not in VLM_TYPES:
        raise ConfigError(f"model '{name}': vision_tower is read for hf_model_type {', '.join(VLM_TYPES)}, not "
                          f"{model_type}; set hf_model_type: qwen2_5_vl or remove vision_tower")
    if not isinstance(tower, Mapping):
        raise ConfigError(f"model '{name}': vision_tower must be a mapping of sizes ({', '.join(_REQUIRED)})")
    known = set(_REQUIRED) | set(_OPTIONAL) | {"fullatt_block_indexes", "out_hidden_size"}
    unknown = sorted(set(tower) - known)
    if unknown:
        raise ConfigError(f"model '{name}': vision_tower.{unknown[0]} is not a vision tower key; the keys are "
                          f"{', '.join(sorted(known))}")
    sizes = {}
    for key in _REQUIRED + _OPTIONAL:
        value = tower.get(key)
        if value is None and key in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model '{name}': vision_tower.{key}={value!r} must be a whole number >= 1")
        sizes[key] = value
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ConfigError(f"model '{name}': vision_tower.hidden_size={sizes['hidden_size']} is not a multiple of "
                          f"vision_tower.num_heads={sizes['num_heads']}")
    full = tuple(int(i) for i in tower.get("fullatt_block_indexes") or range(sizes["depth"]))
    return VisionTower(out_hidden_size=int(tower.get("out_hidden_size") or hidden_size), fullatt_block_indexes=full,
                       **sizes)


def vision_from_hf_config(cfg: Mapping[str, Any]) -> VisionTower:
    """The tower of an HF ``vision_config``."""
    keys = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size") + _OPTIONAL
    return VisionTower(**{k: int(cfg[k]) for k in keys if k in cfg},
                       fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes") or ()))


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary half-dimensions into (temporal, height, width): [16, 24, 24]
    for head size 128, in the same proportion for other sizes."""
    half = head_dim // 2
    height = (half - half // 4) // 2
    return [half - 2 * height, height, height]
