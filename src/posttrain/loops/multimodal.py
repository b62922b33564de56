"""The images of a multimodal on-policy iteration (``rl_config.is_multimodal``, docs/multimodal.md).

    prompts + images --processor--> expanded prompt ids, pixel_values, image_grid_thw (dock columns)
        --> rollout (generate(images=)) --> [image_embeds, with reuse_image_embeds] --> the log-prob
        passes and the update (each batch row carries its sample's images: SampleImages)

The dock holds one ``pixel_values [patches, dim]`` and ``image_grid_thw [images, 3]`` cell per
sample row (a text-only prompt: no rows); :func:`posttrain.loops.experience.read_batch` hands them
to the training engine beside the rows. With ``reuse_image_embeds`` the phase ``image_embeds`` runs
the actor's (frozen) vision tower once per iteration and writes ``image_embeds [image tokens, (1 + D) * H]``
(Qwen3-VL: the ``D`` deepstack levels beside the merged features);
every later pass (reference, old log-probs, update) reads them instead of running the tower.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models.vlm import MM_KEYS, ImageTextProcessor
from posttrain.training.multimodal import embeds_width, image_embeds
from posttrain.transfer_dock import TransferDock

EMBEDS_COLUMN = "image_embeds"


def dock_columns(reuse_image_embeds: bool) -> tuple[str, ...]:
    """The dock columns a multimodal iteration adds (the images, and the reused embeddings)."""
    return (*MM_KEYS, *((EMBEDS_COLUMN,) if reuse_image_embeds else ()))


def encode_prompts(processor: ImageTextProcessor, image_token_id: int, items: list[dict[str, Any]]
                   ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Each item's prompt ids with its image pads expanded, and the per-prompt image columns."""
    prompts, columns = [], {key: [] for key in MM_KEYS}
    for item in items:
        encoded = processor.encode_images(item["prompts"].tolist(), item.get("images") or [], image_token_id)
        prompts.append(torch.tensor(encoded["input_ids"], dtype=torch.long))
        for key in MM_KEYS:
            columns[key].append(encoded[key])
    return prompts, columns


def rollout_images(batch: dict[str, list[torch.Tensor]], n: int) -> list[dict[str, torch.Tensor] | None]:
    """The images of each prompt of a rollout read (every ``n``-th row: the first sample of a group),
    as the native engine's ``generate(images=)`` takes them (None: a text-only prompt)."""
    out = []
    for k in range(0, len(batch["image_grid_thw"]), n):
        grid = batch["image_grid_thw"][k]
        out.append({"pixel_values": batch["pixel_values"][k], "image_grid_thw": grid.long()} if grid.shape[0] else None)
    return out


@torch.no_grad()
def compute_image_embeds(td: TransferDock, model: torch.nn.Module, count: int, device,
                         vit_micro_batch_size: int | None) -> None:
    """The ``image_embeds`` column: the actor's vision tower on each sample's images (eval mode, no
    gradient), ``count`` rows per read, ``vit_micro_batch_size`` images per tower forward."""
    was_training = model.training
    model.eval()
    try:
        while not td.all_consumed(EMBEDS_COLUMN):
            batch, idx = td.get(EMBEDS_COLUMN, list(MM_KEYS), count)
            width = embeds_width(model)  # (1 + deepstack levels) * hidden size
            embeds = []
            for pixels, grid in zip(batch["pixel_values"], batch["image_grid_thw"]):
                if grid.shape[0] == 0:
                    embeds.append(torch.zeros(0, width))
                    continue
                out = image_embeds(model, pixels.to(device), grid.long().to(device), vit_micro_batch_size)
                embeds.append(out.float().cpu())
            td.put([EMBEDS_COLUMN], idx, [embeds])
    finally:
        model.train(was_training)
