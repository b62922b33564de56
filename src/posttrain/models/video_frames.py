"""A video's model inputs from its frames (Qwen2.5-VL), without Transformers' video processor.

Transformers' ``Qwen2VLVideoProcessor`` imports torchvision, which is not installed here. A video is a
list of frames (PIL images, as the media store keeps them: video files are not decoded). Each frame
goes through the model directory's PIL image processor (its resize, rescale and normalisation) with
one frame per temporal patch; this module only joins the frames along time, in the layout the video
processor writes:

* the frames' common size: every frame is resized to the first frame's size before the image
  processor sizes them (so all frames get one grid);
* an odd frame count (not a multiple of ``temporal_patch_size`` ``T``) is padded by repeating the
  last frame;
* ``pixel_values_videos [t * h * w, C * T * P * P]``: for each temporal patch ``t`` the patches in the
  image processor's spatial order (merge blocks), each holding ``C`` channels of ``T`` frames of
  ``P x P`` pixels; ``video_grid_thw [videos, 3]`` = (frames / T, h, w); a video fills
  ``t * h * w / merge**2`` ``<|video_pad|>`` tokens;
* ``second_per_grid_ts [videos]`` = ``T / fps``: the seconds one temporal patch spans, which
  Qwen2.5-VL's rotary positions scale by its ``tokens_per_second``. The frames carry no timing, so
  ``fps`` is :data:`VIDEO_FPS` (2 frames a second, qwen-vl-utils' default sampling rate).

Qwen3-VL takes the same inputs (its video processor's patch layout is Qwen2-VL's) but no
``second_per_grid_ts``: its processor writes each temporal patch's time into the prompt instead,
``<t seconds>`` before that patch's frame tokens, each patch wrapped in its own
``<|vision_start|> ... <|vision_end|>`` (:func:`frame_timestamps`, :func:`timestamp_text`;
:meth:`posttrain.models.vlm.ImageTextProcessor.encode_images` builds the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

VIDEO_FPS = 2.0  # frames a second of a stored video (its frames carry no timing): qwen-vl-utils' default
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def empty_videos(image_processor) -> dict[str, torch.Tensor]:
    """A sample without videos: no rows (``pixel_values_videos [0, C*T*P*P]``, ``video_grid_thw [0, 3]``,
    ``second_per_grid_ts [0]``)."""
    p, t = int(image_processor.patch_size), int(image_processor.temporal_patch_size)
    return {"pixel_values_videos": torch.zeros(0, 3 * t * p * p), "video_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            "second_per_grid_ts": torch.zeros(0)}


def _common_size(frames: Sequence) -> list:
    """The frames (RGB), each resized to the first frame's size when it differs (bicubic, as the processor)."""
    from PIL import Image

    frames = [frame.convert("RGB") for frame in frames]
    size = frames[0].size
    return [frame if frame.size == size else frame.resize(size, Image.Resampling.BICUBIC) for frame in frames]


def video_patches(image_processor, frames: Sequence) -> tuple[torch.Tensor, list[int]]:
    """One video's ``[t * h * w, C * T * P * P]`` patches and its grid ``[t, h, w]`` (module docstring)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    temporal = int(image_processor.temporal_patch_size)
    patch = int(image_processor.patch_size)
    frames = _common_size(frames)
    frames = frames + [frames[-1]] * (-len(frames) % temporal)
    single = image_processor(images=frames, temporal_patch_size=1, return_tensors="pt")
    grid_h, grid_w = (int(v) for v in single["image_grid_thw"][0, 1:])
    per_frame = torch.as_tensor(single["pixel_values"]).reshape(len(frames), grid_h * grid_w, -1, patch, patch)
    channels = per_frame.shape[2]
    grid_t = len(frames) // temporal
    # [t, T, hw, C, P, P] -> [t, hw, C, T, P, P]: each patch holds T consecutive frames per channel
    joined = per_frame.reshape(grid_t, temporal, grid_h * grid_w, channels, patch, patch).permute(0, 2, 3, 1, 4, 5)
    return joined.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch), [grid_t, grid_h, grid_w]


def video_inputs(image_processor, videos: Sequence[Sequence], fps: float = VIDEO_FPS) -> dict[str, torch.Tensor]:
    """The model's video inputs of ``videos`` (each a list of frames): ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts`` (``temporal_patch_size / fps`` each); no rows for none."""
    if not videos:
        return empty_videos(image_processor)
    patches, grids = zip(*(video_patches(image_processor, frames) for frames in videos))
    seconds = float(image_processor.temporal_patch_size) / float(fps)
    return {"pixel_values_videos": torch.cat(patches).float(), "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "second_per_grid_ts": torch.full((len(videos),), seconds)}


def frame_timestamps(num_frames: int, temporal_patch_size: int, fps: float = VIDEO_FPS) -> list[float]:
    """The seconds of each temporal patch of a ``num_frames`` video (Qwen3-VL's prompt): frame ``i`` is at
    ``i / fps`` (the frames are the sampled ones), an odd count repeats the last frame's index, and a
    patch's time is the mean of its first and last frames' times."""
    indices = list(range(num_frames)) + [num_frames - 1] * (-num_frames % temporal_patch_size)
    times = [index / float(fps) for index in indices]
    return [(times[k] + times[k + temporal_patch_size - 1]) / 2 for k in range(0, len(times), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    """A temporal patch's time as Qwen3-VL's processor writes it before the patch: ``<0.2 seconds>``."""
    return f"<{seconds:.1f} seconds>"
