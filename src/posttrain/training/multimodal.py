"""The multimodal part of a log-prob forward (Qwen2.5-VL on the hf backend).

A multimodal micro-batch is the text layout of :mod:`posttrain.training.batch` plus the
concatenated image inputs of its rows (:func:`posttrain.models.vlm.concat_samples`):
``pixel_values [patches, dim]`` and ``image_grid_thw [images, 3]``, optionally ``image_embeds
[image tokens, H]`` (the vision tower's output computed once, ``reuse_image_embeds``). Here they
become the language model's inputs: ``inputs_embeds [B, T, H]`` (the token embeddings with each
``<|image_pad|>`` replaced by its image feature, in row order) and the model's 3-D rotary
positions (its ``get_rope_index``: an image's tokens take (t, h, w) grid positions, the text after
it continues from the largest) below the plain text positions: ``position_ids [4, B, T]``, the
layout Transformers' Qwen2.5-VL reads for packed rows. Both padded and packed forwards
(:mod:`posttrain.training.remove_padding`) take these instead of ``input_ids``.
"""

from __future__ import annotations

import torch

from posttrain.models.vlm import MM_KEYS
from posttrain.training.batch import default_position_ids


def is_multimodal(batch: dict[str, torch.Tensor]) -> bool:
    """Whether ``batch`` carries images (``image_grid_thw``, or the rows' :class:`SampleImages` under ``images``)."""
    return "image_grid_thw" in batch or "images" in batch


def _vlm(model: torch.nn.Module) -> torch.nn.Module:
    """The Qwen2.5-VL base model (``Qwen2_5_VLModel``) of ``model`` (DDP and PEFT wrappers unwrapped)."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    inner = get_base() if callable(get_base) else inner
    return inner.model


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    return _vlm(model).visual


def image_embeds(model: torch.nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                 micro_batch_size: int | None = None) -> torch.Tensor:
    """The vision tower's features of the images: ``[image tokens, H]`` (tokens of every image, in
    order), ``micro_batch_size`` images per tower forward (None: all at once)."""
    images = int(image_grid_thw.shape[0])
    step = micro_batch_size or max(images, 1)
    patches = image_grid_thw.prod(-1).tolist()
    out, first = [], 0
    for start in range(0, images, step):
        num = int(sum(patches[start:start + step]))
        output = _vlm(model).get_image_features(pixel_values[first:first + num], image_grid_thw[start:start + step],
                                                return_dict=True)
        out += list(output.pooler_output)
        first += num
    return torch.cat(out, dim=0)


def freeze_vision_tower(model: torch.nn.Module, frozen: bool = True) -> None:
    """Train the vision tower or not (``requires_grad``): a frozen tower gets no gradient and no update."""
    for param in vision_tower(model).parameters():
        param.requires_grad_(not frozen)


def multimodal_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with ``inputs_embeds [B, T, H]`` and ``position_ids [4, B, T]`` (the text
    positions, then the 3-D rotary ones) for the language model (the image inputs removed).
    ``batch["image_embeds"]``, when present, is used instead of running the vision tower (it must
    equal :func:`image_embeds` of the same images)."""
    if "pixel_values_videos" in batch or "video_grid_thw" in batch:
        raise ValueError("the batch carries videos (pixel_values_videos / video_grid_thw): posttrain's multimodal "
                         "forward takes images only so far; give the frames as images")
    micro = None
    if "images" in batch:  # the rows' SampleImages (posttrain.models.vlm): joined in row order
        images = batch["images"]
        batch = {**{k: v for k, v in batch.items() if k != "images"}, **images.concat()}
        micro = images.vit_micro_batch_size
        if images.num_images() == 0:  # text-only rows: the plain forward
            return {k: v for k, v in batch.items() if k not in MM_KEYS and k != "image_embeds"}
    vlm = _vlm(model)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    features = batch.get("image_embeds")
    if features is None:
        features = image_embeds(model, batch["pixel_values"], batch["image_grid_thw"], micro)
    embeds = vlm.get_input_embeddings()(ids)
    image_mask = (ids == vlm.config.image_token_id) & attention.bool()
    if int(image_mask.sum()) != features.shape[0]:
        raise ValueError(f"the batch has {int(image_mask.sum())} image tokens for {features.shape[0]} image "
                         f"features: its rows and pixel_values/image_grid_thw do not match")
    embeds = embeds.masked_scatter(image_mask[..., None], features.to(embeds.dtype))
    rope, _ = vlm.get_rope_index(ids, image_mask.int(), image_grid_thw=batch["image_grid_thw"],
                                 attention_mask=attention)
    # row 0: the text positions (restarting per sequence), which the model reads, as Transformers
    # documents, to find the sequences of a packed row (its flash-attention varlen path)
    positions = torch.cat([default_position_ids(attention)[None], rope])
    out = {k: v for k, v in batch.items() if k not in MM_KEYS and k != "image_embeds"}
    out.update(inputs_embeds=embeds, position_ids=positions)
    return out
