"""The reused image embeddings of a multimodal run (``rl_config.reuse_image_embeds``): the actor's
vision tower run once on each sample's images and videos, wherever the actor lives (this process, or each Ray
actor worker on its share of the rows, :mod:`posttrain.cluster.worker`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.training.multimodal import embeds_width, image_embeds


@torch.no_grad()
def embed_samples(model: torch.nn.Module, pixel_values: Sequence[torch.Tensor], image_grid_thw: Sequence[torch.Tensor],
                  device, vit_micro_batch_size: int | None = None, pixel_values_videos: Sequence[torch.Tensor] = (),
                  video_grid_thw: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """One ``[image tokens + video tokens, W]`` float32 CPU tensor per sample (``[0, W]`` for a
    text-only one; ``W``: :func:`~posttrain.training.multimodal.embeds_width`, the deepstack features
    beside the main ones): the tower of ``model`` in eval mode, without gradient, one sample at a time,
    ``vit_micro_batch_size`` images (videos) per tower forward; a sample's image tokens first, then its
    video tokens (``pixel_values_videos``, ``video_grid_thw``: none given, no videos), as
    :meth:`posttrain.models.vlm.SampleImages.concat` splits them."""
    was_training = model.training
    model.eval()
    try:
        width = embeds_width(model)
        videos = list(zip(pixel_values_videos, video_grid_thw)) or [None] * len(image_grid_thw)
        out = []
        for pixels, grid, video in zip(pixel_values, image_grid_thw, videos):
            parts = [torch.zeros(0, width)]
            if grid.shape[0]:
                parts.append(image_embeds(model, pixels.to(device), grid.long().to(device), vit_micro_batch_size))
            if video is not None and video[1].shape[0]:
                parts.append(image_embeds(model, video[0].to(device), video[1].long().to(device), vit_micro_batch_size,
                                          videos=True))
            out.append(torch.cat([part.float().cpu() for part in parts]))
        return out
    finally:
        model.train(was_training)
