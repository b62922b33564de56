"""GRPO with LoRA (PEFT) on the tiny model: only the adapter trains, the reference shares the
backbone (adapter off), checkpoints hold the adapter in PEFT's format, and a resume is exact."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import metrics_by_iteration
from tests.integration.test_grpo_loop import grpo_config

LORA = {"actor_config__lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "actor_config__lora_r": 4, "actor_config__lora_alpha": 8, "rl_config__share_backbone": True,
        "megatron_training__lr": 1e-2}


def test_an_adapter_only_checkpoint_loads_with_peft_and_the_base_is_untouched(tiny_model_dir, tiny_prompt_data,
                                                                           tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **LORA, actor_config__lora_ckpt_filter=True))
    ckpt = tmp_path / "ckpt" / "iter_0000001"
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "base").exists()  # the adapter alone
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, str(ckpt))
    trained_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert trained_b and all(float(p.abs().max()) > 0 for p in trained_b)  # B starts at 0: it trained
    merged = adapted.merge_and_unload().state_dict()
    assert any(not torch.equal(merged[k], before[k]) for k in before)


def test_a_lora_run_resumes_exactly(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    common = {**LORA, "megatron_training__train_iters": 4, "rl_config__epochs": 2, "rl_config__shuffle_mini_batch": True,
              "rl_config__mini_batch_size": 1}
    straight = tmp_path / "straight"
    train(grpo_config(tiny_model_dir, tiny_prompt_data, straight, **common))
    resumed = tmp_path / "resumed"
    train(grpo_config(tiny_model_dir, tiny_prompt_data, resumed, **{**common, "megatron_training__train_iters": 2}))
    assert (resumed / "ckpt" / "iter_0000002" / "base" / "model.safetensors").is_file()  # no filter: the base too
    train(grpo_config(tiny_model_dir, tiny_prompt_data, resumed, **{**common, "actor_config__load": str(resumed / "ckpt")}))
    a, b = metrics_by_iteration(straight / "run"), metrics_by_iteration(resumed / "run")
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    assert a[4]["actor/kl_loss"] > 0  # the reference (the adapter off) differs from the trained actor
    for it in (3, 4):
        keys = [k for k in a[it] if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"]
        for k in keys:
            assert b[it][k] == pytest.approx(a[it][k], rel=1e-5, abs=1e-7), k


def test_the_merged_export_computes_the_adapted_model_and_another_model_is_refused(tiny_model_dir, tiny_prompt_data,
                                                                                   tmp_path):
    """``posttrain convert --merge-lora`` of an adapter-only checkpoint: a plain HF model whose logits
    are the adapted model's within 1e-5. The adapter into a model of another shape: refused by name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from posttrain.cli import main
    from posttrain.errors import ConfigError
    from posttrain.models.lora import load_adapter
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **LORA, actor_config__lora_ckpt_filter=True))
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora", "--load-dir",
                 str(ckpt), "--save-dir", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                            str(ckpt / "iter_0000001")).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    scores = []  # posttrain eval of the LoRA checkpoint evaluates the adapted model (merged on load)
    for model in (ckpt, tmp_path / "merged"):
        out = tmp_path / f"eval_{len(scores)}.json"
        assert main(["eval", "--model", str(model), "--data", tiny_prompt_data, "--limit", "8", "--max-tokens", "8",
                     "--output", str(out)]) == 0
        scores.append(json.loads(out.read_text())["score/mean"])
    assert scores[0] == scores[1]
    other = Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ConfigError, match="this LoRA adapter does not fit the model"):
        load_adapter(other, ckpt / "iter_0000001")


def test_continuing_an_adapter_with_other_lora_keys_is_refused(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.errors import ConfigError
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **LORA))
    with pytest.raises(ConfigError, match=r"actor_config\.lora_r: the run asks for 8 but the adapter in .* has 4"):
        train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path / "again", **{
            **LORA, "actor_config__lora_r": 8, "actor_config__load": str(tmp_path / "ckpt"),
            "megatron_training__train_iters": 2}))
