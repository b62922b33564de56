"""On-policy distillation's keys in the plan (posttrain.config.distill) and in ``posttrain plan``'s
text; where they are refused is tests/unit/config/test_compat.py."""

from __future__ import annotations

from posttrain.commands.plan import format_plan, model_arch
from posttrain.config.distill import DistillOptions
from posttrain.config.plan import resolve_plan
from posttrain.config.run import load_run_config


def test_the_plan_carries_the_teacher_its_mode_and_weight():
    plain = load_run_config("grpo_tiny_qwen2")
    assert resolve_plan(plain, model_arch(plain), device="cpu").distill is None
    cfg = load_run_config("grpo_tiny_qwen2", overrides=["rl_config.teacher_model=runs/teacher",
                                                        "rl_config.distill_mode=mixed", "rl_config.distill_coef=0.5"])
    plan = resolve_plan(cfg, model_arch(cfg), device="cpu")
    assert plan.distill == DistillOptions(teacher="runs/teacher", mode="mixed", coef=0.5)
    assert "on-policy distillation" in format_plan(plan) and "mixed from runs/teacher, distill_coef 0.5" in \
        format_plan(plan)
