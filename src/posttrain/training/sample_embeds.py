"""The reused image embeddings of a multimodal run (``rl_config.reuse_image_embeds``): the actor's
vision tower run once on each sample's images, wherever the actor lives (this process, or each Ray
actor worker on its share of the rows, :mod:`posttrain.cluster.worker`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.training.multimodal import embeds_width, image_embeds


@torch.no_grad()
def embed_samples(model: torch.nn.Module, pixel_values: Sequence[torch.Tensor], image_grid_thw: Sequence[torch.Tensor],
                  device, vit_micro_batch_size: int | None = None) -> list[torch.Tensor]:
    """One ``[image tokens, W]`` float32 CPU tensor per sample (``[0, W]`` for a text-only one; ``W``:
    :func:`~posttrain.training.multimodal.embeds_width`, the deepstack features beside the main ones): the
    tower of ``model`` in eval mode, without gradient, one sample at a time, ``vit_micro_batch_size``
    images per tower forward."""
    was_training = model.training
    model.eval()
    try:
        width = embeds_width(model)
        out = []
        for pixels, grid in zip(pixel_values, image_grid_thw):
            if grid.shape[0] == 0:
                out.append(torch.zeros(0, width))
                continue
            embeds = image_embeds(model, pixels.to(device), grid.long().to(device), vit_micro_batch_size)
            out.append(embeds.float().cpu())
        return out
    finally:
        model.train(was_training)
