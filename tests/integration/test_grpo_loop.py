"""The GRPO loop on the tiny model: parameters move, and a resumed run repeats an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.reward.verifiers import register_verifier
from tests.helpers.configs import OMIT, run_config
from tests.helpers.runs import metrics_by_iteration


@register_verifier("test_digit_share", overwrite=True)
def digit_share(response: str, label: str, **_) -> float:
    """A dense, deterministic reward that random models already vary on: the share of digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def grpo_config(model_dir, data, out, **over):
    """The loop tests' GRPO run (checkpoints in ``out/ckpt`` every iteration, logs in ``out/run``);
    ``over`` sets single keys as ``section__key=value``."""
    sections = {"megatron_training": {"global_batch_size": 2, "micro_batch_size": 4, "seq_length": 48, "lr": 1e-3,
                                      "seed": 3, "bf16": OMIT, "prompt_type": "default", "save": str(out / "ckpt"),
                                      "save_interval": 1},
                "rl_config": {"n_samples_per_prompt": 4, "verifier_function": ["test_digit_share"],
                              "verifier_modules": OMIT, "verifier_parallel": 0, "init_kl_coef": 0.01,
                              "max_prompt_length": 48, "kl_penalty": "low_var_kl", "device": OMIT},
                "generate_config": {"max_num_seqs": 64,
                                    "sampling_config": {"max_tokens": 8, "temperature": 1.0, "top_k": -1}},
                "actor_config": {}}
    for key, value in over.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    return run_config(model_dir, data, out / "run", name="grpo_test", **sections)


def test_one_iteration_changes_every_parameter(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    cfg = grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path)
    metrics = train(cfg)
    for key in ("timing/all", "timing/rollout", "timing/reference_model", "timing/update", "timing/rule_reward",
                "timing/adv", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr",
                "grpo/score/mean", "response_length/mean", "prompt_length/mean", "test_digit_share_rewards/mean",
                "e2e_tps", "update_tps", "vllm_tps"):
        assert key in metrics, key
    assert "timing/old_log_p" not in metrics  # on-policy (mini-batch = global batch, 1 epoch): skipped as the seed
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "iter_0000001").state_dict()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == [], f"parameters not updated: {unchanged}"


def test_resume_repeats_the_uninterrupted_run(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    common = {"megatron_training__train_iters": 4, "rl_config__epochs": 2, "rl_config__shuffle_mini_batch": True,
              "rl_config__mini_batch_size": 1}  # off-policy: old logprobs and mini-batch shuffling are exercised
    straight = tmp_path / "straight"
    train(grpo_config(tiny_model_dir, tiny_prompt_data, straight, **common))
    resumed = tmp_path / "resumed"
    train(grpo_config(tiny_model_dir, tiny_prompt_data, resumed, **{**common, "megatron_training__train_iters": 2}))
    train(grpo_config(tiny_model_dir, tiny_prompt_data, resumed,
                      **{**common, "actor_config__load": str(resumed / "ckpt")}))
    a, b = metrics_by_iteration(straight / "run"), metrics_by_iteration(resumed / "run")
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    state = json.loads((resumed / "ckpt" / "iter_0000002" / "trainer_state.json").read_text())
    assert state["num_threads"] == torch.get_num_threads()  # the resume runs with the same threads
    # every checkpoint carries its model card: the run's config digest and its last metrics
    from posttrain.checkpoint.card import CardInfo

    card = (straight / "ckpt" / "iter_0000004" / "README.md").read_text()
    digest = CardInfo("grpo", "", "", (straight / "run" / "config.json").read_text(), 4).config_digest
    assert digest in card and "# GRPO policy checkpoint, iteration 4" in card
    assert f"| `grpo/score/mean` | {a[4]['grpo/score/mean']:.6g} |" in card
    for it in (3, 4):
        keys = [k for k in a[it] if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"]
        assert "actor/pg_loss" in keys and "grpo/score/mean" in keys
        for k in keys:
            assert b[it][k] == pytest.approx(a[it][k], rel=1e-5, abs=1e-7), k


def test_all_prompts_filtered_is_a_clear_error_before_training(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.errors import DataError
    from posttrain.commands.train import train_config as train

    cfg = grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, rl_config__max_prompt_length=2)
    with pytest.raises(DataError, match="is empty: all 64 prompts are at least max_prompt_length=2 tokens"):
        train(cfg)
    assert not (tmp_path / "ckpt").exists()


def test_tokenizer_that_does_not_fit_the_model_is_a_clear_error(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.errors import ConfigError
    from posttrain.models.init_model import train_tokenizer
    from posttrain.commands.train import train_config as train

    big_tok = tmp_path / "big_tokenizer"
    train_tokenizer([f"word{i} number {i * 7}" for i in range(3000)], vocab_size=600).save_pretrained(big_tok)
    cfg = grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path)
    cfg.actor.load = str(tiny_model_dir)
    cfg.actor.tokenizer_name_or_path = str(big_tok)
    with pytest.raises(ConfigError, match="the tokenizer has .* tokens but the model's embedding has only 300 rows"):
        train(cfg)


CHROME_PHASES = set("BEXiIbensftPOND") | {"M", "C"}  # the Trace Event Format's event types


def trace_events(path) -> list[dict]:
    """The events of a Chrome/Perfetto JSON trace, checked for what the format's loaders need."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert isinstance(events, list) and events
    for e in events:
        assert e.get("ph") in CHROME_PHASES, e
        if e["ph"] != "M":
            assert isinstance(e.get("ts"), (int, float)) and "pid" in e and "tid" in e, e
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, e
    return events


def test_the_profiler_traces_exactly_its_window_and_its_stages(tiny_model_dir, tiny_prompt_data, tmp_path):
    """profiler_config.integrated: iterations 2..3 (end exclusive) of 3 whole, then only the update
    phase of iterations 1 and 2 with the per-op tables; every trace loads as a Chrome trace."""
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    whole = {"profile": True, "profile_step_start": 2, "profile_step_end": 3, "profile_save_path": str(tmp_path / "p1")}
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path / "a", megatron_training__train_iters=3,
                      profiler_config__integrated=whole))
    (trace,) = (tmp_path / "p1" / "integrated" / "rank_0").iterdir()
    assert trace.name == "trace_iter_2.json"
    names = {e.get("name") for e in trace_events(trace)}
    assert {"timing/all", "timing/rollout", "timing/update"} <= names

    stage = {"profile": True, "stage": ["actor_update"], "profile_step_start": 1, "profile_step_end": 3,
             "profile_analysis": True, "profile_save_path": str(tmp_path / "p2")}
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path / "b", megatron_training__train_iters=3,
                      profiler_config__integrated=stage))
    folder = tmp_path / "p2" / "integrated" / "rank_0"
    assert sorted(p.name for p in folder.iterdir()) == [
        "profile_iter_1_actor_update.txt", "profile_iter_2_actor_update.txt",
        "trace_iter_1_actor_update.json", "trace_iter_2_actor_update.json"]
    names = {e.get("name") for e in trace_events(folder / "trace_iter_2_actor_update.json")}
    assert "timing/update" in names and "timing/rollout" not in names and any("aten::" in (n or "") for n in names)
    assert "ops by self time" in (folder / "profile_iter_1_actor_update.txt").read_text()


def test_a_deepseek_v3_model_trains_on_the_hf_backend(tiny_model_dir, tiny_prompt_data, tmp_path):
    """The model yaml's DeepSeek-V3 keys (MLA, shared experts, the grouped sigmoid router) build a model
    that one GRPO iteration trains: its attention latents and shared experts move."""
    from transformers import AutoModelForCausalLM

    from posttrain.commands.train import train_config as train
    from posttrain.models.init_model import init_model_dir

    torch.set_num_threads(1)
    keys = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
            "padded_vocab_size": 384, "multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 24,
            "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "num_experts": 4,
            "moe_ffn_hidden_size": 32, "moe_router_topk": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 2, "moe_router_group_topk": 1, "max_position_embeddings": 256}
    model = init_model_dir("tiny_deepseek", keys, tmp_path / "model", tokenizer=tiny_model_dir)
    train(grpo_config(model, tiny_prompt_data, tmp_path, megatron_training__train_iters=1))
    before = AutoModelForCausalLM.from_pretrained(model)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "iter_0000001")
    assert type(after).__name__ == "DeepseekV3ForCausalLM"
    old = before.state_dict()
    moved = {k for k, v in after.state_dict().items() if not torch.equal(v, old[k])}
    for layer in (0, 1):
        for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert f"model.layers.{layer}.self_attn.{part}.weight" in moved, part
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in moved
    assert "model.layers.0.mlp.down_proj.weight" in moved  # the dense first layer (first_k_dense_replace)
