"""A multimodal SFT run's samples: each sample's token ids, labels and images (``rl_config.is_multimodal``
with stage ``sft``), and its videos.

The text rows are an :class:`~posttrain.data.datasets.SFTDataset` (``AlpacaStyleInstructionHandler``
data); the images are the media store that ``posttrain preprocess`` writes beside them
(:mod:`posttrain.data.media_store`), read as the GRPO prompts read theirs
(:class:`~posttrain.data.image_prompts.ImagePromptDataset`: the same checks and messages). ``ds[i]``
adds ``images`` (decoded PIL images), ``videos`` (each a list of PIL frames) and ``row`` (the stored
row number, for messages) to the sample; its ids still hold one unexpanded image (video) pad per
image (video), which the SFT loop expands
(:mod:`posttrain.loops.sft_images`).
"""

from __future__ import annotations

from typing import Any

from posttrain.data.image_prompts import ImagePromptDataset


class ImageSFTDataset(ImagePromptDataset):
    """``ImageSFTDataset(samples: SFTDataset, prefix, images_per_sample, videos_per_sample=0)``: the
    samples with the images and videos of each row; a sample with more than ``images_per_sample``
    images (``generate_config.limit_mm_image_per_prompt``) or more than ``videos_per_sample`` videos
    (``limit_mm_video_per_prompt``) is refused when read."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = super().__getitem__(i)
        item["row"] = int(self.prompts.rows[i])
        return item
