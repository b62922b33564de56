"""Every config key honest: one test per refused key (the error names section, key and value and says
what to do), the keys that are only refused with their feature's switch, and the one start-up warning
about knobs with no effect on this hardware."""

from __future__ import annotations

import copy
import glob
import os

import pytest

from posttrain.commands.seed_plans import RECIPES
from posttrain.config.check import check_run_config
from posttrain.config.features import check_features, startup_warnings
from posttrain.config.fields import Status, field_rule
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.config.sections import GenerateConfig, MsprobeConfig, ProfilerConfig, RLConfig, SamplingConfig
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "actor_resource": {"num_npus": 1}},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.micro_batch_size=2"]


def config(overrides=(), base=BASE):
    return run_config_from_dict(copy.deepcopy(base), overrides=list(overrides))


def refusal(overrides, device_type="cpu") -> str:
    with pytest.raises(ConfigError) as err:
        check_features(config(overrides), device_type)
    return str(err.value)


MP = "tensor/pipeline/expert parallelism needs backend megatron, and backend is hf"
TQ = "TransferQueue (transferqueue 0.1.11) binds its ZMQ sockets to free ports that it picks itself"
EPLB = "expert load balancing (EPLB) is not implemented"

# (overrides, the start of the message: section.key=value[, ...]: why, what to do)
CASES = [
    # model parallelism: TP/PP/VPP select the megatron backend; with backend hf each is named
    (["actor_config.backend=hf", "actor_config.tensor_model_parallel_size=2"],
     f"actor_config.tensor_model_parallel_size=2: {MP}", "set it to 1, or remove backend: hf"),
    (["actor_config.backend=hf", "actor_config.tensor_model_parallel_size=4",
      "actor_config.pipeline_model_parallel_size=2"],
     f"actor_config.tensor_model_parallel_size=4, actor_config.pipeline_model_parallel_size=2: {MP}",
     "set them to 1, or remove backend: hf"),
    (["megatron_training.backend=hf", "megatron_training.pipeline_model_parallel_size=2"],
     "megatron_training.pipeline_model_parallel_size=2: ", "set it to 1"),
    (["actor_config.backend=hf", "actor_config.expert_model_parallel_size=2"],
     f"actor_config.expert_model_parallel_size=2: {MP}", "set it to 1, or remove backend: hf"),
    # what posttrain's models always are, refused when a config writes otherwise
    (["megatron_training.vocab_extra_ids=4"], "megatron_training.vocab_extra_ids=4: extra sentinel ids",
     "remove the key or set it to 0"),
    (["megatron_training.disable_bias_linear=false"], "megatron_training.disable_bias_linear=false: posttrain's "
     "models are", "set it to true"),
    (["actor_config.normalization=LayerNorm"], "actor_config.normalization=LayerNorm: posttrain's models are",
     "set it to RMSNorm"),
    (["actor_config.swiglu=false"], "actor_config.swiglu=false: posttrain's models are", "set it to true"),
    (["actor_config.attention_bias=true"], "actor_config.attention_bias=true: posttrain's models are",
     "add_qkv_bias puts bias on the QKV projection"),
    (["actor_config.position_embedding_type=learned_absolute"],
     "actor_config.position_embedding_type=learned_absolute: posttrain's models are", "set it to rope"),
    (["actor_config.use_rotary_position_embeddings=false"],
     "actor_config.use_rotary_position_embeddings=false: posttrain's models are", "set it to true"),
    (["actor_config.context_parallel_size=2"],
     "actor_config.context_parallel_size=2: context parallelism is not verified on the megatron backend yet",
     "set context_parallel_size 1"),
    (["actor_config.backend=hf", "actor_config.num_layers_per_virtual_pipeline_stage=2"],
     f"actor_config.num_layers_per_virtual_pipeline_stage=2: {MP}", "remove the key"),
    ([*PPO, "critic_config.tensor_model_parallel_size=2"], "critic_config.tensor_model_parallel_size=2: ",
     "set it to 1"),
    # other Megatron keys
    (["megatron_training.ai_framework=mindspore"],
     "megatron_training.ai_framework=mindspore: posttrain runs on PyTorch", "remove the key"),
    (["megatron_training.tokenizer_type=Llama2Tokenizer"], "megatron_training.tokenizer_type=Llama2Tokenizer: ",
     "set it to PretrainedFromHF"),
    (["actor_config.mm_model=vit"], "actor_config.mm_model=vit: posttrain reads the vision-language model from its "
     "Hugging Face directory", "remove the key"),
    # rl_config
    (["rl_config.vit_resource.num_npus=1"], "rl_config.vit_resource={num_npus: 1}: the ViT on devices of its own "
     "waits for separated ViT roles", "remove the key"),
    (["rl_config.reward_resource.num_npus=2"],
     "rl_config.reward_resource={num_npus: 2}: in integrated mode the reward model runs on the actor's devices",
     "give it actor_resource's num_npus"),
    ([*PPO, "rl_config.critic_resource.num_npus=2"], "rl_config.critic_resource={num_npus: 2}: in integrated mode the critic runs on",
     "give it actor_resource's num_npus"),
    (["rl_config.transfer_queue_data_shard_port_base=7000"],
     f"rl_config.transfer_queue_data_shard_port_base=7000: {TQ}", "remove the key"),
    # generate_config
    (["generate_config.enable_prefix_caching=true"], "generate_config.enable_prefix_caching=true: prefix caching",
     "set it to false"),
    (["generate_config.eplb_token_collects=true"], f"generate_config.eplb_token_collects=true: {EPLB}",
     "set it to false"),
    (["generate_config.expert_map_path=map.json"], f"generate_config.expert_map_path=map.json: {EPLB}",
     "remove the key"),
    (["generate_config.infer_pipeline_parallel_size=2"], "generate_config.infer_pipeline_parallel_size=2: ",
     "set it to 1"),
    # whole sections and the critic's keys that follow the actor
    ([*PPO, "critic_config.save_interval=7"], "critic_config.save_interval=7: the critic is saved at the actor's",
     "the actor's value"),
    ([*PPO, "actor_config.save=/ckpt/actor", "critic_config.no_save_optim=true"],
     "critic_config.no_save_optim=true: the critic is saved inside the actor's checkpoints", "the actor's value"),
]
# keys refused only with their feature's switch on: (the key's override, the switch's override)
GATED = [
    ("generate_config.eplb_token_save_path=/tmp/eplb", "generate_config.eplb_token_collects=true"),
]


def test_base_config_has_nothing_refused_or_warned():
    for device in ("cpu", "cuda"):
        check_features(config(), device)
        assert startup_warnings(config(), device) == []


@pytest.mark.parametrize("overrides,start,todo", CASES, ids=[c[1][:60] for c in CASES])
def test_refused_key_names_section_key_value_and_what_to_do(overrides, start, todo):
    message = refusal(overrides)
    assert message.startswith(start), message
    assert todo in message.split("; ")[-1], message


@pytest.mark.parametrize("key,switch", GATED, ids=[g[0] for g in GATED])
def test_switch_gated_keys_are_refused_only_with_their_switch(key, switch):
    check_features(config([key]), "cpu")  # the seed does nothing with them either while the switch is off
    assert refusal([key, switch]).startswith(switch.replace("=true", "=true:"))


def _refused_fields():
    for section, cls in (("megatron", MegatronConfig), ("rl_config", RLConfig), ("generate_config", GenerateConfig),
                         ("sampling_config", SamplingConfig), ("profiler_config", ProfilerConfig),
                         ("msprobe_config", MsprobeConfig)):
        for name in cls.model_fields:
            if field_rule(cls, name).status is Status.REFUSED:
                yield section, name


def test_every_refused_key_has_a_test():
    overrides = [o for case in CASES for o in case[0]] + [key for key, _ in GATED] + OFFLOAD
    tested = {part for o in overrides for part in o.split("=")[0].split(".")}
    missing = [f"{section}.{name}" for section, name in _refused_fields() if name not in tested]
    assert not missing, f"refused keys without a test case: {missing}"


def test_lora_rank_at_its_default_is_not_lora():
    check_features(config(["actor_config.lora_r=8", "actor_config.lora_alpha=16"]), "cpu")


def test_tokenizer_type_of_the_seed_is_fine():
    check_features(config(["megatron_training.tokenizer_type=PretrainedFromHF"]), "cpu")


def test_refusals_follow_the_section_that_wrote_the_key(tmp_path):
    """A key from a model yaml is named by the model (the seed's merge: a section's model first)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.yaml").write_text("m:\n  num_layers: 2\n  ai_framework: mindspore\n")
    (tmp_path / "c.yaml").write_text("defaults:\n  - model: [m]\nmegatron_training:\n  model: m\n"
                                     "  stage: ray_grpo\n")
    cfg = load_run_config("c", tmp_path)
    with pytest.raises(ConfigError, match=r"^model\.m\.ai_framework=mindspore: posttrain runs on PyTorch"):
        check_features(cfg, "cpu")


OFFLOAD = ["generate_config.offload_train_optimizer=true", "generate_config.offload_train_grad=true",
           "generate_config.offload_train_param=true"]


def test_offload_is_honoured_on_cuda_and_only_warned_on_cpu():
    """The optimizer state leaves a GPU between updates and the weights during rollout (the setups
    whose rollout reads the weights themselves are refused by the compatibility table:
    tests/unit/config/test_compat.py); on a CPU the two have no effect and are listed once
    (gradients are freed between updates on any device)."""
    for keys in (OFFLOAD[:2], OFFLOAD):
        check_features(config(keys), "cuda")
        assert startup_warnings(config(keys), "cuda") == []
    cfg = config(OFFLOAD)
    check_features(cfg, "cpu")
    assert startup_warnings(cfg, "cpu") == [
        "keys with no effect on this hardware (cpu): generate_config.offload_train_optimizer, "
        "generate_config.offload_train_param"]


def test_device_defaults_to_rl_config_device(monkeypatch):
    """A key refused on one kind of device only (none is, today: a rule made so here) is refused
    where ``rl_config.device`` resolves to it."""
    from posttrain.config.fields import refused

    extra = GenerateConfig.model_fields["offload_train_param"].json_schema_extra
    monkeypatch.setitem(extra, "status", refused("a test rule", "remove the key", devices=("cuda",)).to_json())
    check_features(config(["generate_config.offload_train_param=true", "rl_config.device=cpu"]))
    with pytest.raises(ConfigError, match="offload_train_param"):
        check_features(config(["generate_config.offload_train_param=true", "rl_config.device=cuda:1"]))


def test_generate_config_is_not_read_by_offline_stages():
    """dpo / sft never roll out: the seed's default infer TP (8) and rollout keys are irrelevant there."""
    base = {"megatron_training": {"stage": "dpo", "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 64},
            "generate_config": {"enable_prefix_caching": True, "offload_train_param": True}}
    cfg = config(base=base)
    check_features(cfg, "cuda")
    assert startup_warnings(cfg, "cpu") == []
    with pytest.raises(ConfigError, match="transfer_queue_data_shard_port_base"):  # other sections still count
        check_features(config(["rl_config.transfer_queue_data_shard_port_base=7000"], base=base), "cpu")


# ---- the one start-up warning ---------------------------------------------------------------------
def test_warning_lists_inert_kernels_once_on_cpu():
    cfg = config([*PPO, "megatron_training.use_flash_attn=true", "megatron_training.use_fused_rmsnorm=true"])
    assert cfg.critic is not None  # the critic merges megatron_training too: still listed once
    assert startup_warnings(cfg, "cpu") == [
        "keys with no effect on this hardware (cpu): megatron_training.use_flash_attn, "
        "megatron_training.use_fused_rmsnorm"]


def test_warning_on_cuda_lists_only_what_is_still_inert_there():
    cfg = config(["megatron_training.use_flash_attn=true", "megatron_training.use_fused_rmsnorm=true"])
    # sdpa picks flash kernels on CUDA by itself; fused RMSNorm is still a Megatron kernel
    assert startup_warnings(cfg, "cuda") == [
        "keys with no effect on this hardware (cuda): megatron_training.use_fused_rmsnorm"]


def test_warning_only_for_keys_the_config_writes_with_an_active_value():
    # the seed's defaults (dropout 0.1, backend nccl) are not written: nothing to warn about
    assert startup_warnings(config(), "cpu") == []
    # the seed's configs write dropout 0 (what runs) and sequence_parallel false (the default)
    assert startup_warnings(config(["megatron_training.attention_dropout=0.0",
                                    "megatron_training.sequence_parallel=false"]), "cpu") == []
    cfg = config(["megatron_training.attention_dropout=0.1", "megatron_training.distributed_backend=nccl"])
    assert startup_warnings(cfg, "cpu") == [
        "keys with no effect on this hardware (cpu): megatron_training.attention_dropout, "
        "megatron_training.distributed_backend"]
    assert startup_warnings(cfg, "cuda") == [  # nccl is what runs on CUDA
        "keys with no effect on this hardware (cuda): megatron_training.attention_dropout"]


def test_reset_attention_mask_false_is_named_as_having_no_effect():
    """Packed rows always attend within their own sequence: false changes nothing, and the warning says so."""
    assert startup_warnings(config(["actor_config.reset_attention_mask=true"]), "cpu") == []
    assert startup_warnings(config(["actor_config.reset_attention_mask=false"]), "cpu") == [
        "keys with no effect on this hardware (cpu): actor_config.reset_attention_mask"]


def test_rollout_parallel_sizes_are_warned_not_refused():
    cfg = config(["generate_config.infer_tensor_parallel_size=2", "rl_config.actor_resource.num_npus=2"])
    check_features(cfg, "cuda")
    assert startup_warnings(cfg, "cuda") == [
        "keys with no effect on this hardware (cuda): generate_config.infer_tensor_parallel_size"]


def test_ignored_keys_of_run_config_still_list_megatron_keys():
    cfg = config(["megatron_training.sequence_parallel=true", "megatron_training.use_fused_rmsnorm=true",
                  "megatron_training.use_flash_attn=true"])  # flash attention does something on CUDA
    assert cfg.ignored_keys == ["sequence_parallel", "use_fused_rmsnorm"]


# ---- the shipped configs ------------------------------------------------------------------------
SHIPPED = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                                                          "configs", "*.yaml")))
SEED_LAYOUTS = set(RECIPES) - {"dapo_qwen25_7b_multi_turn"}  # the seed's TP/PP recipes


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs(name):
    cfg = load_run_config(name)
    if name in SEED_LAYOUTS:  # the seed's TP/PP layouts select the megatron backend, which refuses them on a CPU
        with pytest.raises(ConfigError, match=r"\(backend megatron: \w+\.tensor_model_parallel_size=\d > 1\)"):
            check_run_config(cfg, device_type="cpu")
    elif name == "dapo_qwen25_7b_multi_turn":  # the seed's multi-turn run at TP 1 (hf): nothing refused; the
        for device in ("cpu", "cuda"):          # seed's cluster knobs (nccl, vLLM memory, ...) are inert here
            check_features(cfg, device)
            assert all(w.startswith("keys with no effect") for w in startup_warnings(cfg, device))
    else:  # the configs meant to run here: nothing refused, nothing inert
        for device in ("cpu", "cuda"):
            check_features(cfg, device)
            assert startup_warnings(cfg, device) == []


def test_seed_configs_once_on_one_process():
    """With the layout set to one process, the seed's 7B config passes on CPU with one warning
    (its offload_train_param among the keys without effect), and on CUDA, where its weights leave
    the GPU during rollout (the native engine samples from its bf16 copy), with none."""
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=["actor_config.tensor_model_parallel_size=1",
                                                          "actor_config.pipeline_model_parallel_size=1"])
    check_features(cfg, "cpu")
    [warning] = startup_warnings(cfg, "cpu")
    assert "megatron_training.use_fused_rmsnorm" in warning and "generate_config.offload_train_param" in warning
    assert cfg.generate.offload_train_param
    check_features(cfg, "cuda")
    assert not any("offload_train_param" in w for w in startup_warnings(cfg, "cuda"))


def test_graph_mode_runs_on_a_gpu_and_is_only_warned_about_on_a_cpu():
    """``enforce_eager: false``: the native engine's CUDA-graph decode on a GPU (no warning), no effect
    on a CPU (listed once); the per-request loop of async_engine / multi-turn cannot capture graphs."""
    graphs = ["generate_config.enforce_eager=false"]
    assert startup_warnings(config(graphs), "cuda") == []
    assert "generate_config.enforce_eager" in " ".join(startup_warnings(config(graphs), "cpu"))
    with pytest.raises(ConfigError, match=r"enforce_eager: false \(CUDA graphs\) with rl_config.async_engine"):
        check_run_config(config(graphs + ["rl_config.async_engine=true"]), device_type="cuda")
    check_run_config(config(graphs + ["rl_config.async_engine=true"]), device_type="cpu")  # eager there anyway


def test_speculation_is_checked_against_the_decode_it_needs():
    def refused(overrides, device_type="cpu"):
        with pytest.raises(ConfigError) as err:
            check_run_config(config(overrides), device_type=device_type)
        return str(err.value)

    _, warnings = check_run_config(config(["generate_config.num_speculative_tokens=4"]), device_type="cpu")
    assert not any("speculative" in w for w in warnings)
    assert "num_speculative_tokens=-1: must be an integer >= 0 (0: off)" in refused(
        ["generate_config.num_speculative_tokens=-1"])
    assert "CUDA graphs" in refused(["generate_config.num_speculative_tokens=4", "generate_config.enforce_eager=false"],
                                    device_type="cuda")
