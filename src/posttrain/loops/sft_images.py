"""The images of a multimodal SFT batch (``rl_config.is_multimodal`` with stage ``sft``, docs/multimodal.md).

    sample ids + labels + images --processor--> ids with each image pad expanded to its image's
        tokens (labels -100 there), pixel_values, image_grid_thw --> the SFT batch's rows, and their
        images beside them (SampleImages), which every micro-batch split keeps with their rows

The forward (:mod:`posttrain.training.multimodal`) runs the vision tower on each micro-batch's
images, puts the features at the image tokens and builds the model's 3-D rotary positions; the loss
is the SFT loss on the response tokens, as for text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.data.handlers import IGNORE_INDEX
from posttrain.errors import DataError
from posttrain.models.vlm import ImageTextProcessor


def expand_labels(ids: Sequence[int], labels: Sequence[int], counts: Sequence[int],
                  image_token_id: int) -> tuple[list[int], list[int]]:
    """``ids`` with the ``k``-th ``image_token_id`` repeated ``counts[k]`` times, and ``labels`` to
    match (-100 on every image token: an image is never a training target)."""
    out_ids, out_labels, it = [], [], iter(counts)
    for token, label in zip(ids, labels):
        if token == image_token_id:
            n = int(next(it))
            out_ids += [token] * n
            out_labels += [IGNORE_INDEX] * n
        else:
            out_ids.append(token)
            out_labels.append(label)
    return out_ids, out_labels


def image_samples(items: list[dict[str, Any]], processor: ImageTextProcessor, image_token_id: int, prefix: str
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[dict[str, torch.Tensor]]]:
    """Each item's ``(input_ids, labels)`` with its image pads expanded, and its ``{pixel_values,
    image_grid_thw}`` (no rows for a text-only sample). A sample whose image pads do not match its
    images (e.g. cut off by ``seq_length``) is refused with its row of ``prefix`` named."""
    samples, images = [], []
    for item in items:
        ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
        try:
            encoded = processor.encode_images(ids, item.get("images") or [], image_token_id)
        except ValueError as err:
            raise DataError(f"{prefix}: SFT sample {item.get('row', '?')}: {err} (a sample longer than "
                            f"megatron_training.seq_length loses its end; raise seq_length, or re-run "
                            f"posttrain preprocess)") from None
        grid = encoded["image_grid_thw"]
        counts = (grid.prod(-1) // processor.merge ** 2).tolist()
        ids, labels = expand_labels(ids, labels, counts, image_token_id)
        samples.append((np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)))
        images.append({"pixel_values": encoded["pixel_values"], "image_grid_thw": grid.long()})
    return samples, images
