"""The multimodal keys a run reads (``rl_config.is_multimodal`` and its companions), derived once.

The keys that cannot combine with a multimodal run are refused by the compatibility table
(:mod:`posttrain.config.compat`, rows ``mm-*``); docs/multimodal.md says what runs where.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.run import RunConfig


@dataclass(frozen=True)
class MultimodalOptions:
    """A multimodal run's settings: the most images a prompt may hold (``limit_mm_image_per_prompt``),
    whether the vision tower is trained (not ``freeze_vision_tower``), whether its image embeddings
    are computed once per iteration and reused by every pass (``reuse_image_embeds``, read
    ``embeds_dispatch_size`` rows at a time) and how many images one vision-tower forward takes
    (``vit_forward_micro_batch_size``; None: a micro-batch's images at once); the most videos a prompt
    may hold (``limit_mm_video_per_prompt``; Qwen2.5-VL, :mod:`posttrain.models.video_frames`)."""

    images_per_prompt: int = 1
    videos_per_prompt: int = 0
    freeze_vision_tower: bool = False
    reuse_image_embeds: bool = False
    embeds_dispatch_size: int | None = None
    vit_micro_batch_size: int | None = None

    def describe(self) -> str:
        """In words, for ``posttrain plan``."""
        tower = "frozen" if self.freeze_vision_tower else "trained"
        embeds = (f"computed once per iteration, {self.embeds_dispatch_size} rows a read (reuse_image_embeds)"
                  if self.reuse_image_embeds else "recomputed by every pass")
        vit = f"{self.vit_micro_batch_size} image(s)" if self.vit_micro_batch_size else "a micro-batch's images"
        videos = f", <= {self.videos_per_prompt} video(s)" if self.videos_per_prompt else ""
        return (f"<= {self.images_per_prompt} image(s){videos} a prompt; vision tower {tower}; image embeddings {embeds}; "
                f"{vit} per tower forward")


def multimodal_options(cfg: RunConfig, dispatch_sizes: dict[str, int]) -> MultimodalOptions | None:
    """The options of a run with ``rl_config.is_multimodal: true`` (None for a text run): GRPO, DAPO
    or SFT (PPO and DPO with it are refused by the compatibility table, row mm-stage)."""
    rl = cfg.rl
    if not rl.is_multimodal:
        return None
    return MultimodalOptions(images_per_prompt=cfg.generate.limit_mm_image_per_prompt,
                             videos_per_prompt=cfg.generate.limit_mm_video_per_prompt,
                             freeze_vision_tower=rl.freeze_vision_tower, reuse_image_embeds=rl.reuse_image_embeds,
                             embeds_dispatch_size=dispatch_sizes.get("actor_image_embeds_dispatch_size"),
                             vit_micro_batch_size=rl.vit_forward_micro_batch_size)
