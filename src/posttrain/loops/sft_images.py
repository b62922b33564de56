"""The images and videos of a multimodal SFT batch (``rl_config.is_multimodal`` with stage ``sft``,
docs/multimodal.md).

    sample ids + labels + images + videos --processor--> ids with each image (video) pad expanded to
        its image's (video's) tokens (labels -100 there), pixel_values, image_grid_thw and the video
        inputs (pixel_values_videos, video_grid_thw, second_per_grid_ts: posttrain.models.video_frames)
        --> the SFT batch's rows, and their media beside them (SampleImages), which every micro-batch
        split keeps with their rows

The forward (:mod:`posttrain.training.multimodal`) runs the vision tower on each micro-batch's
images and videos, puts the features at the image and video tokens and builds the model's 3-D
rotary positions; the loss is the SFT loss on the response tokens, as for text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from posttrain.data.handlers import IGNORE_INDEX
from posttrain.errors import DataError
from posttrain.models.vlm import MM_KEYS, VIDEO_PAD, ImageTextProcessor


def expand_labels(ids: Sequence[int], labels: Sequence[int], counts: Mapping[int, Sequence[int]]
                  ) -> tuple[list[int], list[int]]:
    """``ids`` with the ``k``-th occurrence of each token ``t`` of ``counts`` (an image or video pad)
    repeated ``counts[t][k]`` times, and ``labels`` to match (-100 on every such token: an image or a
    video is never a training target)."""
    out_ids, out_labels, left = [], [], {token: iter(sizes) for token, sizes in counts.items()}
    for token, label in zip(ids, labels):
        if token in left:
            n = int(next(left[token]))
            out_ids += [token] * n
            out_labels += [IGNORE_INDEX] * n
        else:
            out_ids.append(token)
            out_labels.append(label)
    return out_ids, out_labels


def image_samples(items: list[dict[str, Any]], processor: ImageTextProcessor, image_token_id: int, prefix: str
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[dict[str, torch.Tensor]]]:
    """Each item's ``(input_ids, labels)`` with its image and video pads expanded, and its media inputs
    (:data:`~posttrain.models.vlm.MM_KEYS`; no rows for a text-only sample). A sample whose pads do
    not match its images or videos (e.g. cut off by ``seq_length``) is refused with its row of
    ``prefix`` named."""
    samples, media = [], []
    for item in items:
        ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
        videos = item.get("videos") or []
        video_id = processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD) if videos else None
        try:
            encoded = processor.encode_images(ids, item.get("images") or [], image_token_id, videos=videos,
                                              video_token_id=video_id)
        except ValueError as err:
            raise DataError(f"{prefix}: SFT sample {item.get('row', '?')}: {err} (a sample longer than "
                            f"megatron_training.seq_length loses its end; raise seq_length, or re-run "
                            f"posttrain preprocess)") from None
        if video_id is not None and processor.frame_timestamps:  # Qwen3-VL: times written around the frames
            ids, labels = encoded["input_ids"], prompt_labels(ids, labels, encoded["input_ids"], prefix, item)
        else:
            counts = {image_token_id: (encoded["image_grid_thw"].prod(-1) // processor.merge ** 2).tolist()}
            if video_id is not None:
                counts[video_id] = (encoded["video_grid_thw"].prod(-1) // processor.merge ** 2).tolist()
            ids, labels = expand_labels(ids, labels, counts)
        samples.append((np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)))
        cells = {key: encoded[key] for key in MM_KEYS}
        cells.update(image_grid_thw=cells["image_grid_thw"].long(), video_grid_thw=cells["video_grid_thw"].long())
        media.append(cells)
    return samples, media


def prompt_labels(ids: Sequence[int], labels: Sequence[int], expanded: Sequence[int], prefix: str,
                  item: dict[str, Any]) -> list[int]:
    """The labels of ``expanded`` (``ids`` with its videos' prompt written by the processor, which also
    re-tokenizes the text before a video: :meth:`~posttrain.models.vlm.ImageTextProcessor.encode_images`):
    -100 up to the first labelled token of ``ids``, whose tokens and labels follow unchanged. A video
    among the labelled tokens is refused."""
    first = next((k for k, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    tail = len(ids) - first
    if len(expanded) < tail or list(expanded[len(expanded) - tail:]) != list(ids[first:]):
        raise DataError(f"{prefix}: SFT sample {item.get('row', '?')}: a video among the trained (response) tokens; "
                        f"Qwen3-VL's videos are taken in the prompt only: move the <video> mark into the prompt")
    return [IGNORE_INDEX] * (len(expanded) - tail) + list(labels[first:])
