"""A multimodal run's prompts: each prompt's token ids and its images (``rl_config.is_multimodal``).

The text rows are a :class:`~posttrain.data.datasets.PromptDataset`; the images are the media store
written beside them by ``posttrain preprocess`` (:mod:`posttrain.data.media_store`: document ``r``
holds the images and videos of stored text row ``r``). ``ds[i]`` adds ``images`` (decoded PIL images)
and ``videos`` (each a list of PIL frames) to the prompt's item; its ids still hold one unexpanded
image (video) pad per image (video): the processor expands them at batch time
(:meth:`posttrain.models.vlm.ImageTextProcessor.encode_images`).
"""

from __future__ import annotations

from typing import Any

from posttrain.data.datasets import PromptDataset
from posttrain.data.media_store import ImageDataset, field_prefix, has_media, IMAGES_FIELD
from posttrain.errors import DataError


class ImagePromptDataset:
    """``prompts`` with the images and videos of each row; a prompt with more than ``images_per_prompt``
    images (``generate_config.limit_mm_image_per_prompt``) or more than ``videos_per_prompt`` videos
    (``limit_mm_video_per_prompt``) is refused when read."""

    def __init__(self, prompts: PromptDataset, prefix: str, images_per_prompt: int, videos_per_prompt: int = 0):
        if not has_media(prefix):
            raise DataError(f"rl_config.is_multimodal: true, but the dataset {prefix} has no images "
                            f"({field_prefix(prefix, IMAGES_FIELD)}.idx is missing): preprocess a dataset with an "
                            f"images column (docs/data.md), or set is_multimodal: false")
        self.prompts, self.prefix, self.images_per_prompt = prompts, prefix, images_per_prompt
        self.videos_per_prompt = videos_per_prompt
        self.media = ImageDataset(prefix)
        stored = len(prompts.fields["input_ids"])
        if len(self.media) != stored:
            raise DataError(f"{field_prefix(prefix, IMAGES_FIELD)}: images of {len(self.media)} prompts for {stored} "
                            f"text rows (the files come from different runs); re-run posttrain preprocess")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getattr__(self, name: str) -> Any:  # rows, num_filtered, prompt_lengths: the text dataset's
        return getattr(self.prompts, name)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = dict(self.prompts[i])
        row = int(self.prompts.rows[i])
        media = self.media[row]
        if len(media["videos"]) > self.videos_per_prompt:
            raise DataError(f"{self.prefix}: prompt {row} holds {len(media['videos'])} video(s), more than "
                            f"generate_config.limit_mm_video_per_prompt={self.videos_per_prompt}; raise the limit "
                            f"or drop the prompt")
        if len(media["images"]) > self.images_per_prompt:
            raise DataError(f"{self.prefix}: prompt {row} holds {len(media['images'])} images, more than "
                            f"generate_config.limit_mm_image_per_prompt={self.images_per_prompt}; raise the limit "
                            f"or drop the prompt")
        item["images"] = [image.convert("RGB") for image in media["images"]]
        item["videos"] = [[frame.convert("RGB") for frame in frames] for frames in media["videos"]]
        return item
