"""The images of a multimodal on-policy iteration (``rl_config.is_multimodal``, docs/multimodal.md).

    prompts + images --processor--> expanded prompt ids, pixel_values, image_grid_thw (dock columns)
        --> rollout (generate(images=)) --> [image_embeds, with reuse_image_embeds] --> the log-prob
        passes and the update (each batch row carries its sample's images: SampleImages)

The dock holds one ``pixel_values [patches, dim]`` and ``image_grid_thw [images, 3]`` cell per
sample row (a text-only prompt: no rows), and the videos' ``pixel_values_videos``, ``video_grid_thw``
and ``second_per_grid_ts`` beside them (Qwen2.5-VL, ``limit_mm_video_per_prompt``; no rows for none); :func:`posttrain.loops.experience.read_batch` hands them
to the training engine beside the rows. With ``reuse_image_embeds`` the phase ``image_embeds`` runs
the actor's (frozen) vision tower once per iteration on each sample's images and videos and writes
``image_embeds [image tokens + video tokens, (1 + D) * H]`` (Qwen3-VL: the ``D`` deepstack levels
beside the merged features);
every later pass (reference, old log-probs, update) reads them instead of running the tower.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from posttrain.models.vlm import MM_KEYS, VIDEO_PAD, ImageTextProcessor
from posttrain.training.sample_embeds import embed_samples
from posttrain.transfer_dock import TransferDock

EMBEDS_COLUMN = "image_embeds"


def dock_columns(reuse_image_embeds: bool) -> tuple[str, ...]:
    """The dock columns a multimodal iteration adds (the images, and the reused embeddings)."""
    return (*MM_KEYS, *((EMBEDS_COLUMN,) if reuse_image_embeds else ()))


def encode_prompts(processor: ImageTextProcessor, image_token_id: int, items: list[dict[str, Any]]
                   ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Each item's prompt ids with its image (and video) pads expanded, and the per-prompt image and
    video columns (:data:`~posttrain.models.vlm.MM_KEYS`; the video pad's id is the tokenizer's)."""
    prompts, columns = [], {key: [] for key in MM_KEYS}
    for item in items:
        videos = item.get("videos") or []
        video_id = processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD) if videos else None
        encoded = processor.encode_images(item["prompts"].tolist(), item.get("images") or [], image_token_id,
                                          videos=videos, video_token_id=video_id)
        prompts.append(torch.tensor(encoded["input_ids"], dtype=torch.long))
        for key in MM_KEYS:
            columns[key].append(encoded[key])
    return prompts, columns


def rollout_images(batch: dict[str, list[torch.Tensor]], n: int) -> list[dict[str, torch.Tensor] | None]:
    """The images and videos of each prompt of a rollout read (every ``n``-th row: the first sample of
    a group), as the native engine's ``generate(images=)`` takes them (None: a text-only prompt)."""
    return [prompt_media({key: batch[key][k] for key in MM_KEYS if key in batch})
            for k in range(0, len(batch["image_grid_thw"]), n)]


def prompt_media(cells: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """One prompt's media cells (``MM_KEYS``) as ``generate(images=)`` takes them: None for a prompt
    with neither images nor videos."""
    media = cells["image_grid_thw"].shape[0] + (cells["video_grid_thw"].shape[0] if "video_grid_thw" in cells else 0)
    return cells if media else None


def image_embedder(policy, device, vit_micro_batch_size: int | None) -> Callable[..., list[torch.Tensor]]:
    """``embed(pixel_values, image_grid_thw)``: one sample's ``image_embeds`` per entry, from the actor's
    vision tower: the Ray actor workers' (``policy.actor.embed_images``, each worker on its share of
    the rows) or, in this process, ``policy.model``'s."""
    remote = getattr(policy.actor, "embed_images", None)
    if remote is not None:
        return partial(remote, vit_micro_batch_size=vit_micro_batch_size)
    return partial(embed_samples, policy.model, device=device, vit_micro_batch_size=vit_micro_batch_size)


def compute_image_embeds(td: TransferDock, embed: Callable[..., list[torch.Tensor]], count: int) -> None:
    """The ``image_embeds`` column: ``embed`` (:func:`image_embedder`: the actor's vision tower, eval
    mode, no gradient) on each sample's images and videos (a cell: the image tokens' rows, then the
    video tokens'), ``count`` rows per read."""
    while not td.all_consumed(EMBEDS_COLUMN):
        batch, idx = td.get(EMBEDS_COLUMN, list(MM_KEYS), count)
        grids = batch.get("video_grid_thw") or []
        videos = ({"pixel_values_videos": batch["pixel_values_videos"], "video_grid_thw": grids}
                  if any(grid.shape[0] for grid in grids) else {})
        td.put([EMBEDS_COLUMN], idx, [embed(batch["pixel_values"], batch["image_grid_thw"], **videos)])
