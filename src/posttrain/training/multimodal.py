"""The multimodal part of a log-prob forward (Qwen2.5-VL, Qwen3-VL on the hf backend).

A multimodal micro-batch is the text layout of :mod:`posttrain.training.batch` plus the
concatenated image inputs of its rows (:func:`posttrain.models.vlm.concat_samples`):
``pixel_values [patches, dim]`` and ``image_grid_thw [images, 3]``, optionally ``image_embeds
[image tokens, (1 + D) * H]`` (the vision tower's output computed once, ``reuse_image_embeds``).
Here they become the model's inputs beside ``input_ids``:

* ``image_features [image tokens, 1 + D, H]``: the tower's merged features of every image token,
  in row order, and (Qwen3-VL) its ``D`` deepstack features, the merged outputs of the tower blocks
  ``deepstack_visual_indexes`` that the model adds to the hidden states of its first ``D`` decoder
  layers at the image tokens (Qwen2.5-VL: ``D = 0``). The model's forward reads them as
  ``mm_encoder_outputs`` (:func:`model_kwargs`): it puts the merged features at the
  ``<|image_pad|>`` tokens of ``input_ids`` and the deepstack ones at the same tokens (its
  ``visual_pos_masks``), so one code path serves both architectures;
* ``image_mask [B, T]``: where the image tokens are (a packed row reorders the features with it:
  :func:`pack_image_features`);
* ``position_ids [4, B, T]``: the plain text positions (restarting per sequence), then the model's
  3-D rotary positions (its ``get_rope_index`` with ``mm_token_type_ids`` = 1 on image tokens: an
  image's tokens take (t, h, w) grid positions, the text after it continues from the largest), the
  layout Transformers' Qwen-VL models read for packed rows.

Videos (the rows' ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts`` of
:mod:`posttrain.models.video_frames`) go the same way: ``video_features [video tokens, 1 + D, H]`` from
the model's ``get_video_features`` (Qwen3-VL: its deepstack levels too), ``video_mask`` at the
``<|video_pad|>`` tokens, ``mm_token_type_ids`` 2 there. Qwen2.5-VL's ``get_rope_index`` spaces a
video's temporal positions by ``second_per_grid_ts`` times the model's ``tokens_per_second``;
Qwen3-VL's gives each temporal patch (its own ``<|vision_start|>`` block after its ``<t seconds>``
text) the positions of a one-frame image.

Both padded and packed forwards (:mod:`posttrain.training.remove_padding`) take these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from posttrain.models.vlm import MM_KEYS
from posttrain.training.batch import default_position_ids

FEATURES = "image_features"
VIDEO_FEATURES = "video_features"
VIDEO_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")  # the VLMs whose videos posttrain feeds
EMBEDS_KEYS = ("image_embeds", "video_embeds")  # the reused tower features (reuse_image_embeds)
TOWER_ANCHOR = "tower_anchor"  # a text-only DDP micro-batch's zero term of the tower (tower_anchor)


def is_multimodal(batch: dict[str, torch.Tensor]) -> bool:
    """Whether ``batch`` carries images (``image_grid_thw``, or the rows' :class:`SampleImages` under ``images``)."""
    return "image_grid_thw" in batch or "images" in batch


def _vlm(model: torch.nn.Module) -> torch.nn.Module:
    """The VLM base model (``Qwen2_5_VLModel``, ``Qwen3VLModel``) of ``model`` (DDP and PEFT wrappers unwrapped)."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    inner = get_base() if callable(get_base) else inner
    return inner.model


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    return _vlm(model).visual


def embeds_width(model: torch.nn.Module) -> int:
    """The width of :func:`image_embeds`' rows: ``(1 + D) * H`` (``D`` deepstack levels, ``H`` the
    language model's hidden size)."""
    config = _vlm(model).config
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
    return (1 + levels) * int(config.text_config.hidden_size)


def image_embeds(model: torch.nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                 micro_batch_size: int | None = None, videos: bool = False) -> torch.Tensor:
    """The vision tower's features of the images: ``[image tokens, (1 + D) * H]`` (tokens of every
    image, in order; the merged features, then each deepstack level's), ``micro_batch_size`` images
    per tower forward (None: all at once). ``videos``: the inputs are videos (``pixel_values_videos``,
    ``video_grid_thw``), through the model's ``get_video_features``."""
    images = int(image_grid_thw.shape[0])
    step = micro_batch_size or max(images, 1)
    patches = image_grid_thw.prod(-1).tolist()
    out, first = [], 0
    for start in range(0, images, step):
        num = int(sum(patches[start:start + step]))
        encode = _vlm(model).get_video_features if videos else _vlm(model).get_image_features
        output = encode(pixel_values[first:first + num], image_grid_thw[start:start + step], return_dict=True)
        levels = [output.pooler_output, *(getattr(output, "deepstack_features", None) or [])]
        out.append(torch.cat([torch.cat(list(level), dim=0) for level in levels], dim=-1))
        first += num
    return torch.cat(out, dim=0)


def tower_anchor(model: torch.nn.Module) -> torch.Tensor | None:
    """For a text-only micro-batch of a DDP replica whose vision tower trains: zero times the tower's
    features of a blank one-token image, which the forward adds to its log-probs (None otherwise).
    DDP reduces every trainable weight's gradient at each backward and waits for all of them, so a
    rank whose rows hold no image must still give its tower a (zero) gradient. (DDP's
    ``find_unused_parameters`` would mark as unused, then see twice, the LM head that posttrain
    applies outside the model's forward in chunks, when it is not tied to the embeddings.)"""
    if not (isinstance(model, torch.nn.parallel.DistributedDataParallel) and torch.is_grad_enabled()):
        return None
    tower = vision_tower(model)
    param = next(tower.parameters())
    if not param.requires_grad:
        return None
    vision = _vlm(model).config.vision_config
    merge = int(vision.spatial_merge_size)
    grid = torch.tensor([[1, merge, merge]], device=param.device)
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.zeros(merge * merge, width, dtype=param.dtype, device=param.device)
    return 0.0 * image_embeds(model, pixels, grid).float().sum()


def freeze_vision_tower(model: torch.nn.Module, frozen: bool = True) -> None:
    """Train the vision tower or not (``requires_grad``): a frozen tower gets no gradient and no update."""
    for param in vision_tower(model).parameters():
        param.requires_grad_(not frozen)


def _image_features(model: torch.nn.Module, batch: dict[str, torch.Tensor], micro: int | None) -> torch.Tensor:
    """The batch's image tokens' features ``[image tokens, (1 + D) * H]``: its ``image_embeds``, or the tower's."""
    features = batch.get("image_embeds")
    if features is None:
        features = image_embeds(model, batch["pixel_values"], batch["image_grid_thw"], micro)
    return _checked_width(model, features)


def _checked_width(model: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
    if features.shape[-1] != embeds_width(model):
        raise ValueError(f"image_embeds have {features.shape[-1]} features a token, the model's tower gives "
                         f"{embeds_width(model)}: they come from another model")
    return features


def _video_features(model: torch.nn.Module, batch: dict[str, torch.Tensor], micro: int | None) -> torch.Tensor | None:
    """The batch's video tokens' features ``[video tokens, H]`` (Qwen2.5-VL; None without videos)."""
    grid = batch.get("video_grid_thw")
    if grid is None or grid.shape[0] == 0:
        return None
    if "video_embeds" in batch:  # reuse_image_embeds: the tower's features, computed once
        return _checked_width(model, batch["video_embeds"])
    model_type = _vlm(model).config.model_type
    if model_type not in VIDEO_MODEL_TYPES:
        raise ValueError(f"the batch carries videos, which posttrain feeds to {', '.join(VIDEO_MODEL_TYPES)} only, not "
                         f"model_type {model_type}; set generate_config.limit_mm_video_per_prompt: 0 or give a video's "
                         f"frames as images")
    return image_embeds(model, batch["pixel_values_videos"], grid, micro, videos=True)


def _check_tokens(mask: torch.Tensor, features: torch.Tensor | None, what: str) -> None:
    found, given = int(mask.sum()), (0 if features is None else features.shape[0])
    if found != given:
        raise ValueError(f"the batch has {found} {what} tokens for {given} {what} features: its rows and their "
                         f"{what} inputs do not match")


def multimodal_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with ``image_features`` / ``image_mask``, ``video_features`` / ``video_mask`` (where it
    holds videos) and ``position_ids [4, B, T]`` (see the module docstring; the image and video inputs
    removed). ``batch["image_embeds"]``, when present, is used instead of running the vision tower on
    the images (it must equal :func:`image_embeds` of the same images)."""
    micro = None
    if "images" in batch:  # the rows' SampleImages (posttrain.models.vlm): joined in row order
        images = batch["images"]
        batch = {**{k: v for k, v in batch.items() if k != "images"}, **images.concat()}
        micro = images.vit_micro_batch_size
        if images.num_images() == 0:  # text-only rows: the plain forward
            text = {k: v for k, v in batch.items() if k not in (*MM_KEYS, *EMBEDS_KEYS)}
            anchor = tower_anchor(model)
            return text if anchor is None else {**text, TOWER_ANCHOR: anchor}
    vlm = _vlm(model)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    image_mask = (ids == vlm.config.image_token_id) & attention.bool()
    video_mask = (ids == vlm.config.video_token_id) & attention.bool()
    features = _image_features(model, batch, micro) if batch["image_grid_thw"].shape[0] else None
    videos = _video_features(model, batch, micro)
    _check_tokens(image_mask, features, "image")
    _check_tokens(video_mask, videos, "video")
    kinds = image_mask.int() + 2 * video_mask.int()  # the model's mm_token_type_ids: text 0, image 1, video 2
    timing = {} if videos is None else {"video_grid_thw": batch["video_grid_thw"],
                                        "second_per_grid_ts": batch["second_per_grid_ts"]}
    rope, _ = vlm.get_rope_index(ids, kinds, image_grid_thw=batch["image_grid_thw"], attention_mask=attention, **timing)
    # row 0: the text positions (restarting per sequence), which the model reads, as Transformers
    # documents, to find the sequences of a packed row (its flash-attention varlen path)
    positions = torch.cat([default_position_ids(attention)[None], rope])
    out = {k: v for k, v in batch.items() if k not in (*MM_KEYS, *EMBEDS_KEYS)}
    hidden = int(vlm.config.text_config.hidden_size)
    if features is not None:
        out.update({FEATURES: features.reshape(features.shape[0], -1, hidden), "image_mask": image_mask})
    if videos is not None:
        out.update({VIDEO_FEATURES: videos.reshape(videos.shape[0], -1, hidden), "video_mask": video_mask})
    out["position_ids"] = positions
    return out


def pack_image_features(batch: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``image_features`` (and ``video_features``) of a packed row
    (:func:`posttrain.training.remove_padding.pack`; ``order [N]``: the flat padded token of each
    packed position), in the order of its image (video) tokens; none for a batch without them."""
    out = {}
    for features, mask_key in ((FEATURES, "image_mask"), (VIDEO_FEATURES, "video_mask")):
        if features in batch:
            mask = batch[mask_key].reshape(-1)
            rank = mask.long().cumsum(0) - 1  # flat padded token -> its row in the features
            out[features] = batch[features].index_select(0, rank[order[mask[order]]])
    return out


@dataclass
class EncodedImages(BaseModelOutputWithPooling):
    """The tower's output as a Qwen-VL forward reads it from ``mm_encoder_outputs["image"]`` (a
    Transformers model output): ``pooler_output``, the merged features, and ``deepstack_features``,
    each deepstack level's (a tuple of per-image chunks each; here one chunk of all image tokens)."""

    deepstack_features: list[tuple[torch.Tensor, ...]] | None = None


def model_kwargs(batch: dict[str, torch.Tensor]) -> dict:
    """The model's keyword arguments for the images and videos of ``batch`` (its ``image_features``,
    ``video_features``): its ``mm_encoder_outputs``; none for a text batch."""
    encoded = {}
    for kind, key in (("image", FEATURES), ("video", VIDEO_FEATURES)):
        if key in batch:
            levels = batch[key].unbind(1)
            encoded[kind] = EncodedImages(pooler_output=(levels[0],), deepstack_features=[(lv,) for lv in levels[1:]])
    return {"mm_encoder_outputs": encoded} if encoded else {}
