"""Images in a native-engine request: the processor's tensors and the model's 3-D rotary positions.

A request with images gives its prompt ids with every image pad already expanded (one
``image_token_id`` per merged patch, as the model's processor writes them) and an :class:`ImageInputs`:
the processor's ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3]. The prefill
runs the model on them: its forward embeds the images into the pad positions. The rotary positions
come from the model's own ``get_rope_index`` (Qwen2.5-VL, Qwen3-VL: 3-D positions, temporal x
height x width, on image tokens; text tokens continue after ``max`` of an image's positions), and a
per-prompt ``rope delta`` (the prompt's last position + 1 - prompt length; not the model's own delta,
which counts from the largest position: a video's temporal positions may pass the text after it)
shifts every decode position, so decode feeds text tokens at ``prompt length + t + delta`` as the
model's ``generate`` does (it continues from the last position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import ConfigError, DataError

# the model types whose greedy tokens with images are compared with their own ``generate``
# (tests/unit/rollout/test_native_images.py); another vision model may need other prefill inputs
TESTED_MODEL_TYPES = {"qwen2_5_vl", "qwen3_vl"}
VIDEO_MODEL_TYPES = {"qwen2_5_vl", "qwen3_vl"}  # ... and with videos (tests/e2e/test_e2e_multimodal_video.py)
TIMED_VIDEO_TYPES = {"qwen2_5_vl"}  # take second_per_grid_ts (Qwen3-VL: the times are in the prompt)


@dataclass
class ImageInputs:
    """One request's images as the processor gives them: ``pixel_values`` [patches, dim] and
    ``image_grid_thw`` [images, 3] (patches along time, height, width of each image); and its videos
    (Qwen2.5-VL, :mod:`posttrain.models.video_frames`): ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts`` (None, or no rows, for none)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    @classmethod
    def of(cls, value: Any, index: int) -> "ImageInputs | None":
        """``value`` (None, an ImageInputs, or a dict with the two image keys and optionally the video
        keys) for request ``index``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict) and {"pixel_values", "image_grid_thw"} <= set(value):
            videos = {}
            if value.get("video_grid_thw") is not None and len(value["video_grid_thw"]):
                videos = {"pixel_values_videos": torch.as_tensor(value["pixel_values_videos"]),
                          "video_grid_thw": torch.as_tensor(value["video_grid_thw"]).long(),
                          "second_per_grid_ts": torch.as_tensor(value["second_per_grid_ts"]).float()}
            return cls(torch.as_tensor(value["pixel_values"]), torch.as_tensor(value["image_grid_thw"]).long(), **videos)
        raise DataError(f"images[{index}]: give None, an ImageInputs or a dict with 'pixel_values' and "
                        f"'image_grid_thw' (the image processor's output); got {type(value).__name__}.")

    def tokens(self, merge: int) -> int:
        """How many image tokens the prompt holds for these images (``t*h*w / merge**2`` each)."""
        return int(self.image_grid_thw.long().prod(-1).sum()) // (merge * merge)

    def video_tokens(self, merge: int) -> int:
        """How many video tokens the prompt holds for these videos."""
        grid = self.video_grid_thw
        return 0 if grid is None else int(grid.long().prod(-1).sum()) // (merge * merge)


VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model: Any) -> list[int]:
    """The ids of the vision special tokens a vision-language model's config names (none for a text
    model). The engine never samples them: a sampled ``<|image_pad|>`` in a response would be one image
    token more than the row's images fill, and the training forward refuses such a row."""
    config = getattr(model, "config", None)
    ids = [getattr(config, key, None) for key in VISION_TOKEN_KEYS]
    return sorted({int(i) for i in ids if isinstance(i, int) and i >= 0})


def vision_model(model: Any) -> Any:
    """The module that defines ``get_rope_index`` (``model.model`` of a ``*ForConditionalGeneration``,
    also through a PEFT wrapper, whose ``model`` attribute reaches the wrapped model), or None when
    the model takes no images."""
    module = model
    for _ in range(4):
        if module is None or callable(getattr(module, "get_rope_index", None)):
            return module
        module = getattr(module, "model", None)
    return None


def check_requests(model: Any, prompts: list[list[int]], images: list) -> list[ImageInputs | None]:
    """``images`` (one entry per prompt) checked against the model and the prompts' image pads."""
    if len(images) != len(prompts):
        raise DataError(f"generate(): images has {len(images)} entries for {len(prompts)} prompts; give one "
                        "per prompt (None for a text-only prompt).")
    entries = [ImageInputs.of(value, i) for i, value in enumerate(images)]
    if all(entry is None for entry in entries):
        return entries
    config = getattr(model, "config", None)
    if vision_model(model) is None or getattr(config, "image_token_id", None) is None:
        raise ConfigError(f"generate(images=...): {type(model).__name__} takes no images (no get_rope_index); "
                          "use a vision-language model such as Qwen2.5-VL, or drop the images.")
    if config.model_type not in TESTED_MODEL_TYPES:
        raise ConfigError(f"generate(images=...): the native engine's image prefill is tested on "
                          f"{sorted(TESTED_MODEL_TYPES)} only, not model_type {config.model_type!r}; use one of those.")
    pad, merge = int(config.image_token_id), int(config.vision_config.spatial_merge_size)
    video = getattr(config, "video_token_id", None)
    for i, (prompt, entry) in enumerate(zip(prompts, entries)):
        want = 0 if entry is None else entry.tokens(merge)
        if prompt.count(pad) != want:
            raise DataError(f"prompt {i} holds {prompt.count(pad)} image tokens (id {pad}) but its images need "
                            f"{want}: expand each image pad as the model's processor does (t*h*w/{merge}**2 a picture).")
        videos = 0 if entry is None else entry.video_tokens(merge)
        if video is not None and prompt.count(int(video)) != videos:
            raise DataError(f"prompt {i} holds {prompt.count(int(video))} video tokens (id {video}) but its videos "
                            f"need {videos}: expand each video pad as posttrain.models.video_frames does.")
        if videos and config.model_type not in VIDEO_MODEL_TYPES:
            raise ConfigError(f"generate(images=...): prompt {i} holds a video; the native engine takes videos for "
                              f"{sorted(VIDEO_MODEL_TYPES)} only, not model_type {config.model_type!r}; give the "
                              f"frames as images.")
    return entries


def _videos(present: list[ImageInputs], device) -> dict[str, torch.Tensor]:
    """The requests' video inputs joined (none when no request has a video)."""
    videos = [entry for entry in present if entry.video_grid_thw is not None and entry.video_grid_thw.shape[0]]
    if not videos:
        return {}
    return {key: torch.cat([getattr(entry, key) for entry in videos]).to(device)
            for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")}


def prefill_inputs(model: Any, ids: torch.Tensor, mask: torch.Tensor,
                   images: list[ImageInputs | None]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A prefill chunk's image and video arguments (``pixel_values``, ``image_grid_thw``, the video keys
    where a row has videos, ``mm_token_type_ids``: 1 on image tokens, 2 on video tokens; none when no
    row has images), its 3-D positions [3, P, L] (0 on left padding) and the rows' rope deltas [P]."""
    present = [entry for entry in images if entry is not None]
    config = model.config
    kinds = (ids == int(config.image_token_id)).int()
    if getattr(config, "video_token_id", None) is not None:
        kinds = kinds + 2 * (ids == int(config.video_token_id)).int()
    if not present:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return {}, positions[None].expand(3, -1, -1), torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    grid = torch.cat([entry.image_grid_thw for entry in present]).to(ids.device)
    videos = _videos(present, ids.device)
    positions, _ = vision_model(model).get_rope_index(
        ids, mm_token_type_ids=kinds, image_grid_thw=grid, video_grid_thw=videos.get("video_grid_thw"),
        second_per_grid_ts=videos.get("second_per_grid_ts"), attention_mask=mask)
    # the decode continues after the prompt's last position, as generate does (its last position + 1), not after
    # the largest one: a video's temporal positions (spaced by second_per_grid_ts) may pass the text after it
    deltas = positions[:, :, -1].max(0).values + 1 - mask.sum(-1)
    pixels = torch.cat([entry.pixel_values for entry in present]).to(ids.device)
    if config.model_type not in TIMED_VIDEO_TYPES:
        videos.pop("second_per_grid_ts", None)
    inputs = {"mm_token_type_ids": kinds, **videos}
    if grid.shape[0]:
        inputs.update(pixel_values=pixels, image_grid_thw=grid)
    return inputs, positions, deltas.reshape(-1).to(ids.device)
