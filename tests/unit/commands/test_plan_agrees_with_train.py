"""``posttrain plan`` never calls valid what ``posttrain train`` refuses at start-up (issue 40 item 2).

The refusals that ``train`` made only after the one config check (when the KL controller, the
Megatron workers or the checkpoint loader started) now live in that check
(:func:`posttrain.config.check.collect_checks`). Each case below runs through both commands: both
stop with exit status 2 and the same message, and ``train`` stops before it builds anything."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import forbid, run_cli, write_config

MEGATRON = ["actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_npus=2"]


def kl_horizon(world, tmp_path) -> list[str]:
    return ["rl_config.kl_ctrl_type=adaptive", "rl_config.kl_horizon=0"]


def deepseek_on_megatron(world, tmp_path) -> list[str]:
    """A DeepSeek-V3 model directory (its config.json, as init-model writes it) on the megatron backend."""
    from posttrain.models.arch import arch_from_model_yaml

    keys = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
            "padded_vocab_size": 384, "multi_latent_attention": True, "qk_layernorm": True, "kv_lora_rank": 16,
            "num_experts": 4, "n_shared_experts": 1, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_ffn_hidden_size": 32}
    model = tmp_path / "deepseek"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(arch_from_model_yaml("tiny", keys).to_hf_config()))
    return [f"actor_config.load={model}", "actor_config.sequence_parallel=true", *MEGATRON]


def legacy_checkpoint_at_another_layout(world, tmp_path) -> list[str]:
    """A legacy (per-rank) Megatron checkpoint saved at TP 1 x PP 1, loaded at TP 2."""
    from posttrain.models.mcore.convert import hf_to_mcore

    saved = tmp_path / "mg"
    hf_to_mcore(world / "model", saved, tp=1, pp=1, log=lambda *a: None)
    return [f"actor_config.load={saved}", *MEGATRON]


def missing_teacher(world, tmp_path) -> list[str]:
    return [f"rl_config.teacher_model={tmp_path / 'no_teacher'}"]


CASES = {
    "missing_teacher": (missing_teacher, "rl_config.teacher_model: "),
    "kl_horizon": (kl_horizon, "rl_config.kl_horizon must be larger than 0"),
    "deepseek_v3_on_megatron": (deepseek_on_megatron, "multi-latent attention (DeepSeek-V3) is not mapped to "
                                                      "Megatron-Core; use backend hf"),
    "legacy_checkpoint_layout": (legacy_checkpoint_at_another_layout,
                                 "was saved at TP 1 x PP 1 x EP 1 with 1 virtual stage(s)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_refuses_what_train_refuses_at_start_up(case, mini_world, tmp_path, capsys, monkeypatch):
    build, message = CASES[case]
    overrides = build(mini_world, tmp_path)
    config = write_config(mini_world, tmp_path / "run")
    code, plan_err = run_cli(["plan", *config, *overrides], capsys)
    assert code == 2 and message in plan_err, plan_err
    forbid(monkeypatch, "posttrain.commands.train:train")  # train stops at its check, as plan does, before any work
    code, train_err = run_cli(["train", *config, *overrides], capsys)
    assert code == 2 and message in train_err, train_err
    line = next(x for x in plan_err.splitlines() if message in x)
    assert line in train_err.splitlines(), (line, train_err)
