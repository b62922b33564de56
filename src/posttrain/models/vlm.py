"""Vision-language models (Qwen2.5-VL, Qwen3-VL) on the hf backend: the model directory, its processor, and the
per-sample multimodal inputs of a batch.

A sample's image inputs are what the processor gives: ``pixel_values [patches, C * T_p * P * P]``
(every image's patches, flattened) and ``image_grid_thw [images, 3]`` (each image's temporal,
height and width patch counts; an image fills ``t * h * w / merge**2`` ``<|image_pad|>`` tokens of
the prompt). A micro-batch concatenates its samples' rows in sample order, which is the order in
which the model fills the image tokens of the batch's rows. A sample's videos ride beside them
(``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``: Qwen2.5-VL, Qwen3-VL,
:mod:`posttrain.models.video_frames`), filling its ``<|video_pad|>`` tokens in the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from posttrain.errors import ConfigError
from posttrain.models.video_frames import VIDEO_KEYS, empty_videos, frame_timestamps, timestamp_text, video_inputs
from posttrain.models.vision_arch import KINDS, VISION_TOKENS, VLM_TYPES, VisionTower

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# Qwen2.5-VL's and Qwen3-VL's chat template, reduced to its content parts: a message's content is a
# string or a list of {"type": "image"} and {"type": "text", "text": ...} parts; an image part becomes the
# placeholder the processor expands.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
# a sample's image and video inputs, as the batch and the dock name them (no rows for none)
MM_KEYS = (*IMAGE_KEYS, *VIDEO_KEYS)


def is_vlm_dir(path: str | Path) -> bool:
    """Whether the HF model directory ``path`` holds a vision-language model (its config.json)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in VLM_TYPES and "vision_config" in cfg


MEGATRON_HF_SUBDIR = "hf"  # a multimodal megatron checkpoint's iteration: the trained VLM as a Hugging Face directory


def saved_vlm_dir(it_dir: str | Path) -> Path | None:
    """The trained VLM that a multimodal megatron run saved in its checkpoint iteration ``it_dir``
    (``iter_XXXXXXX/hf``), or None where there is none (a text run's, or a converted ``release``)."""
    hf_dir = Path(it_dir) / MEGATRON_HF_SUBDIR
    return hf_dir if Path(it_dir).name.startswith("iter_") and is_vlm_dir(hf_dir) else None


def add_vision_tokens(tokenizer) -> dict[str, int]:
    """Add the vision special tokens to ``tokenizer`` (with the VLM chat template); their config ids."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return {key: tokenizer.convert_tokens_to_ids(token) for token, key in VISION_TOKENS.items()}


def save_processor(directory: str | Path, tokenizer, tower: VisionTower) -> None:
    """Write the tokenizer and the image processor of ``tower``'s architecture (Transformers' PIL
    Qwen2-VL image processor, which Qwen2.5-VL and Qwen3-VL share; no torchvision needed) into
    ``directory``: ``tower``'s patches, images of 4 to 256 merged patches (56x56 to 392x392 pixels at
    patch 14), the architecture's normalisation. (Transformers' processor object cannot be built
    without a video processor, which needs torchvision; :func:`load_processor` reads these files.)"""
    from transformers import Qwen2VLImageProcessorPil

    merged = (tower.patch_size * tower.spatial_merge_size) ** 2
    images = Qwen2VLImageProcessorPil(patch_size=tower.patch_size, merge_size=tower.spatial_merge_size,
                                      temporal_patch_size=tower.temporal_patch_size, min_pixels=4 * merged,
                                      max_pixels=256 * merged, **KINDS[tower.model_type].image_processor)
    images.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


class ImageTextProcessor:
    """The tokenizer and image processor of a VLM directory, called like Transformers' Qwen2.5-VL
    processor: ``processor(text=[...], images=[...])`` expands each ``<|image_pad|>`` of ``text`` to its
    image's ``t * h * w / merge**2`` tokens. (Transformers' own ``AutoProcessor`` for Qwen2.5-VL also
    builds a video processor, which needs torchvision; use it where torchvision is installed.)"""

    def __init__(self, tokenizer, image_processor, frame_timestamps: bool = False):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.merge = int(image_processor.merge_size)
        self.frame_timestamps = frame_timestamps  # Qwen3-VL: a video's prompt holds its patches' times

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def save_pretrained(self, directory: str | Path) -> None:
        """The tokenizer and ``preprocessor_config.json`` into ``directory`` (a checkpoint loads with
        :func:`load_processor`, and with ``AutoProcessor`` where torchvision is installed)."""
        self.image_processor.save_pretrained(str(directory))
        self.tokenizer.save_pretrained(str(directory))

    def encode_images(self, prompt_ids: Sequence[int], images: Sequence, image_token_id: int,
                      videos: Sequence[Sequence] = (), video_token_id: int | None = None) -> dict:
        """One prompt's token ids (each ``image_token_id`` expanded to its image's tokens, each
        ``video_token_id`` to its video's, as ``__call__`` expands the text) and its image and video
        inputs (:data:`MM_KEYS`; no rows for none; videos: :mod:`posttrain.models.video_frames`)."""
        ids = list(prompt_ids)
        out = {**empty_images(self.image_processor), **video_inputs(self.image_processor, list(videos))}
        if images:
            vision = self.image_processor(images=list(images), return_tensors="pt")
            out.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
        ids = _expand_ids(ids, image_token_id, out["image_grid_thw"], self.merge, "image")
        if videos and self.frame_timestamps:
            ids = self._timestamped_videos(ids, video_token_id, out["video_grid_thw"], [len(v) for v in videos])
        elif videos or video_token_id is not None:
            ids = _expand_ids(ids, video_token_id, out["video_grid_thw"], self.merge, "video")
        return {"input_ids": ids, **out}

    def _timestamped_videos(self, ids: list[int], video_token_id: int, grid_thw: torch.Tensor,
                            frame_counts: Sequence[int]) -> list[int]:
        """Qwen3-VL's video prompt, as its processor writes the text: each video pad (with the
        ``<|vision_start|>``/``<|vision_end|>`` around it, when there are) becomes, for each temporal
        patch, ``<t seconds>``, ``<|vision_start|>``, the patch's ``h * w / merge**2`` pads,
        ``<|vision_end|>``. The tokenizer splits a text at its added (special) tokens and tokenizes
        the pieces apart, so the first ``<t seconds>`` is tokenized with the text piece before it
        (decoded from ``ids`` back to the last added token: ``" <"`` may be one token), the others alone."""
        if ids.count(video_token_id) != len(frame_counts):
            raise ValueError(f"the prompt holds {ids.count(video_token_id)} video tokens for {len(frame_counts)} videos")
        start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
        temporal = int(self.image_processor.temporal_patch_size)
        out, videos, skip = [], iter(zip(grid_thw.tolist(), frame_counts)), False
        for i, token in enumerate(ids):
            if skip:  # the wrapper's end: each patch has its own
                skip = False
                continue
            if token != video_token_id:
                out.append(token)
                continue
            (_, h, w), frames = next(videos)
            skip = out[-1:] == [start] and ids[i + 1:i + 2] == [end]
            if skip:
                out.pop()
            for k, seconds in enumerate(frame_timestamps(frames, temporal)):
                stamp = self._text_before(out) if k == 0 else ""
                out += [*self.tokenizer(stamp + timestamp_text(seconds), add_special_tokens=False)["input_ids"],
                        start, *[video_token_id] * (h * w // self.merge ** 2), end]
        return out

    def _text_before(self, out: list[int]) -> str:
        """The text of ``out``'s last piece (after its last added token), removed from ``out``."""
        added = set(self.tokenizer.added_tokens_decoder)
        first = len(out)
        while first and out[first - 1] not in added:
            first -= 1
        text = self.tokenizer.decode(out[first:], clean_up_tokenization_spaces=False) if first < len(out) else ""
        del out[first:]
        return text

    def __call__(self, text: Sequence[str], images=None, return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        text = list(text)
        if images:
            vision = self.image_processor(images=list(images), return_tensors="pt")
            out.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
            counts = iter((vision["image_grid_thw"].prod(-1) // self.merge ** 2).tolist())
            pad = "<|image_pad|>"
            text = [_expand(t, pad, counts) for t in text]
        out.update(self.tokenizer(text, return_tensors=return_tensors, padding=True))
        return out


def empty_images(image_processor) -> dict[str, torch.Tensor]:
    """A text-only sample's inputs: no rows (``pixel_values [0, C*T*P*P]``, ``image_grid_thw [0, 3]``, and
    the empty video inputs of :func:`posttrain.models.video_frames.empty_videos`)."""
    p, t = int(image_processor.patch_size), int(image_processor.temporal_patch_size)
    return {"pixel_values": torch.zeros(0, 3 * t * p * p), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            **empty_videos(image_processor)}


def _expand_ids(ids: list[int], token_id: int | None, grid_thw: torch.Tensor, merge: int, what: str) -> list[int]:
    """``ids`` with each ``token_id`` repeated by its item's ``t*h*w / merge**2`` (``grid_thw`` rows in order)."""
    counts = (grid_thw.prod(-1) // merge ** 2).tolist()
    found = ids.count(token_id) if token_id is not None else 0
    if found != len(counts):
        raise ValueError(f"the prompt holds {found} {what} tokens for {len(counts)} {what}s")
    expanded, it = [], iter(counts)
    for token in ids:
        expanded.extend([token] * int(next(it)) if token == token_id else [token])
    return expanded


def _expand(text: str, pad: str, counts) -> str:
    """``text`` with every ``pad`` repeated by the next count of ``counts``."""
    pieces = text.split(pad)
    return pieces[0] + "".join(pad * next(counts) + piece for piece in pieces[1:])


def load_processor(path: str | Path) -> ImageTextProcessor:
    """The processor saved in the model directory ``path`` (offline)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    if not (Path(path) / "preprocessor_config.json").is_file():
        raise ConfigError(f"{path}: no preprocessor_config.json; a vision-language model directory needs its "
                          f"image processor (posttrain init-model writes one)")
    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type") if config.is_file() else None
    stamps = model_type in KINDS and KINDS[model_type].frame_timestamps
    return ImageTextProcessor(AutoTokenizer.from_pretrained(str(path)), AutoImageProcessor.from_pretrained(str(path)),
                              frame_timestamps=stamps)


def split_samples(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                  images_per_sample: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """A processor output of several samples as one ``{pixel_values, image_grid_thw}`` per sample
    (``images_per_sample[i]`` images for sample ``i``, in order)."""
    if sum(images_per_sample) != image_grid_thw.shape[0]:
        raise ValueError(f"{sum(images_per_sample)} images for {image_grid_thw.shape[0]} image_grid_thw rows")
    patches = image_grid_thw.prod(-1).tolist()
    out, image, patch = [], 0, 0
    for count in images_per_sample:
        num = int(sum(patches[image:image + count]))
        out.append({"pixel_values": pixel_values[patch:patch + num], "image_grid_thw": image_grid_thw[image:image + count]})
        image, patch = image + count, patch + num
    return out


def concat_samples(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The micro-batch inputs of samples in row order: their ``pixel_values`` and ``image_grid_thw``
    rows (and the video inputs, where every sample carries them) concatenated."""
    keys = [key for key in MM_KEYS if key in IMAGE_KEYS or all(key in s for s in samples)]
    return {key: torch.cat([s[key] for s in samples]) for key in keys}


class SampleImages:
    """The image inputs of a batch's rows, one entry per row (``{pixel_values, image_grid_thw}`` and,
    with ``reuse_image_embeds``, ``image_embeds``; no rows for a text-only sample), carried beside the
    row tensors of a training batch under the key ``images``: it is indexed by rows and moved to a
    device like them, so every micro-batch split (fixed size, token budget, grouped by prompt) keeps
    each sample's images with its row. ``vit_micro_batch_size``: images per vision-tower forward."""

    def __init__(self, samples: Sequence[dict[str, torch.Tensor]], vit_micro_batch_size: int | None = None):
        self.samples = list(samples)
        self.vit_micro_batch_size = vit_micro_batch_size

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def shape(self) -> tuple[int]:
        return (len(self.samples),)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getitem__(self, rows) -> "SampleImages":
        """The entries of ``rows`` (a tensor or list of row indexes, or a slice), in that order."""
        if isinstance(rows, slice):
            rows = range(len(self))[rows]
        index = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        return SampleImages([self.samples[int(i)] for i in index], self.vit_micro_batch_size)

    def to(self, device, non_blocking: bool = False) -> "SampleImages":
        moved = [{k: v.to(device, non_blocking=non_blocking) for k, v in s.items()} for s in self.samples]
        return SampleImages(moved, self.vit_micro_batch_size)

    def num_images(self) -> int:
        """The rows' images and videos."""
        return sum(int(s["image_grid_thw"].shape[0]) + (int(s["video_grid_thw"].shape[0]) if "video_grid_thw" in s else 0)
                   for s in self.samples)

    def concat(self) -> dict[str, torch.Tensor]:
        """The rows' inputs joined in row order (:func:`concat_samples`; ``image_embeds`` too when every
        sample has them, and ``video_embeds`` where they hold videos: a sample's cell holds its image
        tokens' rows, then its video tokens', :func:`split_embeds`)."""
        out = concat_samples(self.samples)
        if self.samples and all("image_embeds" in s for s in self.samples):
            # a text-only sample's cell has no rows (and may be [0, H] beside Qwen3-VL's [N, (1 + D) * H])
            parts = [split_embeds(s) for s in self.samples if s["image_embeds"].shape[0]]
            images = [images for images, _ in parts if images.shape[0]]
            out["image_embeds"] = torch.cat(images) if images else self.samples[0]["image_embeds"][:0]
            if any(videos.shape[0] for _, videos in parts):
                out["video_embeds"] = torch.cat([videos for _, videos in parts])
        return out


def split_embeds(sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's ``image_embeds`` cell as its images' rows and its videos' rows (each image or video
    fills ``t * h * w / merge**2`` rows, one merge size for both: the image tokens' share of the rows
    is the images' share of the patches)."""
    embeds = sample["image_embeds"]
    images = int(sample["image_grid_thw"].prod(-1).sum())
    videos = int(sample["video_grid_thw"].prod(-1).sum()) if "video_grid_thw" in sample else 0
    first = embeds.shape[0] * images // (images + videos) if images + videos else embeds.shape[0]
    return embeds[:first], embeds[first:]
