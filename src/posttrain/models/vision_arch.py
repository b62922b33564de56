"""The vision-language models posttrain builds and trains (Qwen2.5-VL, Qwen3-VL): their vision
towers' sizes, parameter counts and HF keys, and what each architecture fixes in its language model.

A model yaml describes the tower under one posttrain key, ``vision_tower`` (a mapping of the HF
``vision_config`` names); ``hf_model_type`` names the architecture. Every difference between the
architectures lives in one :class:`VisionKind` of :data:`KINDS`:

* ``qwen2_5_vl``: keys ``depth``, ``hidden_size``, ``num_heads``, ``intermediate_size``, ``patch_size``
  (14), ``spatial_merge_size``, ``temporal_patch_size``, ``window_size``, ``fullatt_block_indexes``;
  RMSNorm blocks with a gated MLP; the language model's QKV projections have a bias.
* ``qwen3_vl``: keys ``depth``, ``hidden_size``, ``num_heads``, ``intermediate_size``, ``patch_size``
  (16), ``spatial_merge_size``, ``temporal_patch_size``, ``num_position_embeddings`` (a learned
  position grid), ``deepstack_visual_indexes`` (the tower blocks whose merged features are added to
  the first decoder layers' hidden states at the image tokens); LayerNorm blocks with a plain MLP;
  the language model normalises queries and keys (``qk_layernorm``), no QKV bias, interleaved 3-D rotary;
  a video's prompt holds each temporal patch's time (``frame_timestamps``).

The training forward is the same for both (:mod:`posttrain.training.multimodal` passes the tower's
features, deepstack ones included, through Transformers' ``mm_encoder_outputs``). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError

NOT_BUILT = {"qwen3_vl_moe": "this vision-language model is not built yet (its language model's experts are not "
                             "mapped); use hf_model_type: qwen3_vl or qwen2_5_vl"}
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
    window_size: int = 112  # Qwen2.5-VL: windowed attention ...
    fullatt_block_indexes: tuple[int, ...] = ()  # ... except in these blocks
    model_type: str = "qwen2_5_vl"
    num_position_embeddings: int = 2304  # Qwen3-VL: the learned position grid (a square number)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks feeding the first decoder layers

    def num_params(self) -> int:
        return KINDS[self.model_type].num_params(self)

    def to_hf_config(self) -> dict[str, Any]:
        return KINDS[self.model_type].hf_config(self)


def _qwen25_params(t: VisionTower) -> int:
    """Patch embedding (a bias-free Conv3d), ``depth`` blocks (two RMSNorms, QKV and output
    projections with bias, a gated MLP with bias) and the patch merger (RMSNorm, two linears)."""
    h, f = t.hidden_size, t.intermediate_size
    patch = t.in_channels * t.temporal_patch_size * t.patch_size ** 2 * h
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * f + f) + (f * h + h)
    merged = h * t.spatial_merge_size ** 2
    merger = h + (merged * merged + merged) + (merged * t.out_hidden_size + t.out_hidden_size)
    return patch + t.depth * block + merger


def _qwen3_params(t: VisionTower) -> int:
    """Patch embedding (a Conv3d with bias), the learned position grid, ``depth`` blocks (two
    LayerNorms, QKV and output projections with bias, a two-linear MLP with bias), the patch merger
    (LayerNorm before the merge, two linears) and one deepstack merger per deepstack index
    (LayerNorm after the merge, two linears)."""
    h, f = t.hidden_size, t.intermediate_size
    patch = t.in_channels * t.temporal_patch_size * t.patch_size ** 2 * h + h
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    merged = h * t.spatial_merge_size ** 2
    linears = (merged * merged + merged) + (merged * t.out_hidden_size + t.out_hidden_size)
    deepstack = len(t.deepstack_visual_indexes) * (2 * merged + linears)
    return patch + t.num_position_embeddings * h + t.depth * block + 2 * h + linears + deepstack


def _common_hf(t: VisionTower) -> dict[str, Any]:
    return {"depth": t.depth, "hidden_size": t.hidden_size, "num_heads": t.num_heads,
            "intermediate_size": t.intermediate_size, "out_hidden_size": t.out_hidden_size,
            "patch_size": t.patch_size, "spatial_merge_size": t.spatial_merge_size,
            "temporal_patch_size": t.temporal_patch_size, "in_channels": t.in_channels}


def _qwen25_hf(t: VisionTower) -> dict[str, Any]:
    return {**_common_hf(t), "window_size": t.window_size, "fullatt_block_indexes": list(t.fullatt_block_indexes),
            "hidden_act": "silu"}


def _qwen3_hf(t: VisionTower) -> dict[str, Any]:
    return {**_common_hf(t), "num_position_embeddings": t.num_position_embeddings,
            "deepstack_visual_indexes": list(t.deepstack_visual_indexes), "hidden_act": "gelu_pytorch_tanh"}


def qwen25_mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary half-dimensions into (temporal, height, width): [16, 24, 24]
    for head size 128, in the same proportion for other sizes."""
    half = head_dim // 2
    height = (half - half // 4) // 2
    return [half - 2 * height, height, height]


def qwen3_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's (interleaved) split: [24, 20, 20] for head size 128, in the same proportion for others."""
    half = head_dim // 2
    height = half * 5 // 16
    return [half - 2 * height, height, height]


@dataclass(frozen=True)
class VisionKind:
    """One vision-language architecture: the HF class, the tower's yaml keys and defaults, its
    parameter count and HF ``vision_config``, the language model's rotary split and the attention
    keys the architecture fixes (model-yaml key: value)."""

    hf_class: str
    optional: tuple[str, ...]
    defaults: Mapping[str, Any]
    num_params: Callable[[VisionTower], int]
    hf_config: Callable[[VisionTower], dict[str, Any]]
    mrope: Callable[[int], list[int]]
    mrope_interleaved: bool
    attention: Mapping[str, bool]
    image_processor: Mapping[str, Any] = field(default_factory=dict)  # processor settings beyond the patches
    frame_timestamps: bool = False  # a video's prompt holds each temporal patch's time (models/video_frames.py)


_SIZES = ("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels")
KINDS: dict[str, VisionKind] = {
    "qwen2_5_vl": VisionKind("Qwen2_5_VLForConditionalGeneration", _SIZES + ("window_size",), {"patch_size": 14},
                             _qwen25_params, _qwen25_hf, qwen25_mrope_section, False,
                             {"add_qkv_bias": True, "qk_layernorm": False}),
    "qwen3_vl": VisionKind("Qwen3VLForConditionalGeneration", _SIZES + ("num_position_embeddings",),
                           {"patch_size": 16, "num_position_embeddings": 2304}, _qwen3_params, _qwen3_hf,
                           qwen3_mrope_section, True, {"add_qkv_bias": False, "qk_layernorm": True},
                           {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, frame_timestamps=True),
}
VLM_TYPES = tuple(KINDS)
_REQUIRED = ("depth", "hidden_size", "num_heads", "intermediate_size")
_INDEX_LISTS = {"qwen2_5_vl": "fullatt_block_indexes", "qwen3_vl": "deepstack_visual_indexes"}


def vision_tower(name: str, keys: Mapping[str, Any], model_type: str, hidden_size: int) -> VisionTower | None:
    """The ``vision_tower`` of a model yaml (None for a text model); checked against ``hf_model_type``."""
    tower = keys.get("vision_tower")
    if model_type in NOT_BUILT:
        raise ConfigError(f"model '{name}': hf_model_type={model_type}: {NOT_BUILT[model_type]}")
    if tower is None:
        if model_type in KINDS:
            raise ConfigError(f"model '{name}': hf_model_type={model_type} is a vision-language model; give its "
                              f"vision_tower sizes ({', '.join(_REQUIRED)})")
        return None
    if model_type not in KINDS:
        raise ConfigError(f"model '{name}': vision_tower is read for hf_model_type {', '.join(VLM_TYPES)}, not "
                          f"{model_type}; set hf_model_type to one of them or remove vision_tower")
    if not isinstance(tower, Mapping):
        raise ConfigError(f"model '{name}': vision_tower must be a mapping of sizes ({', '.join(_REQUIRED)})")
    kind = KINDS[model_type]
    _check_attention(name, keys, model_type)
    indexes = _INDEX_LISTS[model_type]
    known = set(_REQUIRED) | set(kind.optional) | {indexes, "out_hidden_size"}
    unknown = sorted(set(tower) - known)
    if unknown:
        raise ConfigError(f"model '{name}': vision_tower.{unknown[0]} is not a {model_type} vision tower key; the "
                          f"keys are {', '.join(sorted(known))}")
    sizes = dict(kind.defaults)
    for key in _REQUIRED + kind.optional:
        value = tower.get(key)
        if value is None and key in kind.optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model '{name}': vision_tower.{key}={value!r} must be a whole number >= 1")
        sizes[key] = value
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ConfigError(f"model '{name}': vision_tower.hidden_size={sizes['hidden_size']} is not a multiple of "
                          f"vision_tower.num_heads={sizes['num_heads']}")
    listed = _block_indexes(name, tower.get(indexes), indexes, sizes["depth"])
    default = tuple(range(sizes["depth"])) if model_type == "qwen2_5_vl" else ()
    return VisionTower(out_hidden_size=int(tower.get("out_hidden_size") or hidden_size), model_type=model_type,
                       **{indexes: listed if listed is not None else default}, **sizes)


def _block_indexes(name: str, value: Any, key: str, depth: int) -> tuple[int, ...] | None:
    """``vision_tower.<key>``: a list of distinct tower block indexes (None when not given)."""
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth
                                                  for i in value) and len(set(value)) == len(value)
    if not ok:
        raise ConfigError(f"model '{name}': vision_tower.{key}={value!r} must be a list of distinct block indexes "
                          f"in 0..{depth - 1} (vision_tower.depth={depth})")
    return tuple(value)


def _check_attention(name: str, keys: Mapping[str, Any], model_type: str) -> None:
    """The language model's attention keys that the architecture fixes (Qwen3-VL: query/key norms, no bias)."""
    for key, wanted in KINDS[model_type].attention.items():
        if bool(keys.get(key, False)) != wanted:
            raise ConfigError(f"model '{name}': {key}={bool(keys.get(key, False))} with hf_model_type={model_type}: "
                              f"its language model is built with {key}={wanted}; set {key}: {str(wanted).lower()}")


def vision_from_hf_config(cfg: Mapping[str, Any], model_type: str = "qwen2_5_vl") -> VisionTower:
    """The tower of an HF ``vision_config`` of a ``model_type`` model."""
    kind = KINDS.get(model_type, KINDS["qwen2_5_vl"])
    keys = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size") + kind.optional
    sizes = {**kind.defaults, **{k: int(cfg[k]) for k in keys if k in cfg}}
    lists = {key: tuple(cfg.get(key) or ()) for key in _INDEX_LISTS.values()}
    return VisionTower(model_type=model_type if model_type in KINDS else "qwen2_5_vl", **sizes, **lists)
