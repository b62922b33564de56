"""On-policy distillation's options (``rl_config.teacher_model``, ``distill_mode``, ``distill_coef``;
the math is :mod:`posttrain.algo.distill`, the teacher is built by :func:`posttrain.roles.policy.build_teacher`).
Where it is refused (offline stages, PPO, the megatron backend, Ray) is in :mod:`posttrain.config.compat`."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.run import RunConfig


@dataclass(frozen=True)
class DistillOptions:
    """The teacher's weights (``teacher``: an HF model directory or checkpoint), the advantage's form
    (``mode``: ``reverse_kl`` or ``mixed``) and the distillation term's weight ``coef``."""

    teacher: str
    mode: str = "reverse_kl"
    coef: float = 1.0


def distill_options(cfg: RunConfig) -> DistillOptions | None:
    """The run's distillation, or None without ``rl_config.teacher_model``."""
    rl = cfg.rl
    if rl.teacher_model is None:
        return None
    return DistillOptions(teacher=rl.teacher_model, mode=rl.distill_mode, coef=rl.distill_coef)
