"""The training backend (posttrain.config.backend): which one a config selects and why, the layout
it derives (data-parallel size, reads, memory per process), and one test per refusal: each names
the key."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.backend import model_parallel, resolve_backend
from posttrain.config.check import check_run_config
from posttrain.config.compat import FEATURES, ROWS
from posttrain.config.plan import build_plan
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.config.validate import validate_run_config
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "actor_resource": {"num_npus": 4}},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}
ARCH = ModelArch(model_type="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=256, tie_embeddings=True)
TP2 = ["actor_config.tensor_model_parallel_size=2"]
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.micro_batch_size=2"]
MEGATRON = "(backend megatron: actor_config.tensor_model_parallel_size=2 > 1)"


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def config(overrides=()):
    return run_config_from_dict(copy.deepcopy(BASE), overrides=list(overrides))


def check(overrides, device_type="cpu", arch=ARCH):
    return check_run_config(config(overrides), device_type=device_type, arch=arch)


def inert(overrides, device_type="cpu") -> str:
    """The start-up warning about keys with no effect ("" when there is none)."""
    _, warnings = check(overrides, device_type)
    return "".join(w for w in warnings if w.startswith("keys with no effect"))


def refusal(overrides, device_type="cpu", arch=ARCH) -> str:
    with pytest.raises(ConfigError) as err:
        check(overrides, device_type, arch)
    return str(err.value)


# ---- which backend -------------------------------------------------------------------------------
@pytest.mark.parametrize("override,reason", [
    ("actor_config.tensor_model_parallel_size=2", "actor_config.tensor_model_parallel_size=2 > 1"),
    ("megatron_training.pipeline_model_parallel_size=2", "megatron_training.pipeline_model_parallel_size=2 > 1"),
    ("actor_config.context_parallel_size=2", "actor_config.context_parallel_size=2 > 1"),
    ("actor_config.expert_model_parallel_size=2", "actor_config.expert_model_parallel_size=2 > 1"),
    ("actor_config.num_layers_per_virtual_pipeline_stage=1", "actor_config.num_layers_per_virtual_pipeline_stage=1 "
                                                             "is set"),
    ("actor_config.backend=megatron", "actor_config.backend=megatron"),
])
def test_auto_selects_megatron_for_model_parallelism(override, reason):
    assert resolve_backend(config([override])) == ("megatron", reason)


def test_auto_selects_hf_without_model_parallelism():
    par = model_parallel(config())
    assert (par.backend, par.reason, par.dp) == ("hf", "no tensor/pipeline/context/expert parallelism asked", 4)
    check([])


def test_layout_of_the_megatron_backend():
    par = model_parallel(config([*TP2, "actor_config.recompute_granularity=full"]))
    assert (par.backend, par.tp, par.pp, par.cp, par.dp) == ("megatron", 2, 1, 1, 2)
    assert par.recompute_granularity == "full"
    assert par.describe() == ("megatron (actor_config.tensor_model_parallel_size=2 > 1): TP 2 x PP 1 x DP 2, "
                              "recompute full")


def test_unknown_backend_is_refused_by_key():
    assert refusal(["megatron_training.backend=fsdp"]).startswith(
        "megatron_training.backend='fsdp': must be one of hf, megatron or null (null: megatron when")


def test_explicit_hf_refuses_tensor_parallelism():
    message = refusal(["actor_config.backend=hf", *TP2])
    assert message.startswith("actor_config.tensor_model_parallel_size=2: tensor/pipeline/expert parallelism needs backend "
                              "megatron")


# ---- the layout the model can be split into ------------------------------------------------------------------
def test_heads_must_divide_by_tp():
    arch = ModelArch(**{**ARCH.__dict__, "num_attention_heads": 6, "num_kv_heads": 6})
    message = refusal(["actor_config.tensor_model_parallel_size=4"], arch=arch)
    assert message.startswith("num_attention_heads=6 is not divisible by actor_config.tensor_model_parallel_size=4")


def test_kv_heads_must_divide_by_tp():
    message = refusal(["actor_config.tensor_model_parallel_size=4"])
    assert message.startswith("num_query_groups=2 is not divisible by actor_config.tensor_model_parallel_size=4")


def test_layers_must_divide_by_pp_and_virtual_stages():
    arch = ModelArch(**{**ARCH.__dict__, "num_layers": 3})
    assert refusal(["actor_config.pipeline_model_parallel_size=2"], arch=arch).startswith(
        "num_layers=3 is not divisible by actor_config.pipeline_model_parallel_size=2")
    message = refusal(["actor_config.pipeline_model_parallel_size=2",
                       "actor_config.num_layers_per_virtual_pipeline_stage=4"])
    assert "num_layers=4 is not divisible by actor_config.pipeline_model_parallel_size x " \
           "actor_config.num_layers_per_virtual_pipeline_stage = 2x4" in message


def test_virtual_stages_need_pipeline_parallelism():
    message = refusal(["actor_config.num_layers_per_virtual_pipeline_stage=2"])
    assert message.startswith("actor_config.num_layers_per_virtual_pipeline_stage=2: virtual pipeline stages need "
                              "pipeline parallelism")


def test_model_yaml_heads_are_named_by_where_they_are_written():
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=["actor_config.tensor_model_parallel_size=8",
                                                          "actor_config.pipeline_model_parallel_size=1"])
    with pytest.raises(ConfigError, match=r"^model\.qwen25_7b\.num_attention_heads=28 is not divisible by "
                                          r"actor_config\.tensor_model_parallel_size=8"):
        check_run_config(cfg, device_type="cpu")


def test_workers_must_divide_by_the_model_parallel_size():
    message = refusal(["actor_config.tensor_model_parallel_size=3"])
    assert "Resource=4 must be divisible by" in message and "rl_config.actor_resource.num_npus" in message


def test_mini_batch_rows_must_divide_by_the_data_parallel_size():
    message = refusal([*TP2, "rl_config.actor_resource.num_npus=8", "rl_config.n_samples_per_prompt=1",
                       "rl_config.mini_batch_size=2", "actor_config.micro_batch_size=1",
                       "megatron_training.micro_batch_size=1"])
    assert "= 2 rows cannot be shared equally by the data-parallel size 4" in message


# ---- refusals of the megatron backend ------------------------------------------------------------------------
def test_context_parallelism_is_refused():
    assert refusal(["actor_config.context_parallel_size=2"]).startswith(
        "actor_config.context_parallel_size=2: context parallelism is not verified on the megatron backend yet; "
        "set context_parallel_size 1")


MOE = ModelArch(**{**ARCH.__dict__, "model_type": "qwen3_moe", "qk_norm": True, "num_experts": 4,
                   "moe_ffn_hidden_size": 32, "norm_topk_prob": True})
EP2 = ["actor_config.expert_model_parallel_size=2"]


def test_expert_parallelism_plans_on_megatron():
    cfg = config(EP2)
    layout, _ = check_run_config(cfg, device_type="cpu", arch=MOE)
    par = build_plan(cfg, layout, MOE, device="cpu").parallel
    assert (par.backend, par.tp, par.ep, par.dp) == ("megatron", 1, 2, 4)
    assert "EP 2 (the experts over the data-parallel ranks)" in par.describe()


@pytest.mark.parametrize("overrides,arch,start", [
    (EP2, ARCH, "actor_config.expert_model_parallel_size=2: the model has no experts (a dense qwen2 model)"),
    (TP2, MOE, "actor_config.tensor_model_parallel_size=2 with num_experts=4: Megatron-Core trains a "
               "mixture-of-experts model with tensor parallelism only under sequence parallelism"),
    (["actor_config.expert_model_parallel_size=4"], ModelArch(**{**MOE.__dict__, "num_experts": 6}),
     "num_experts=6 is not divisible by actor_config.expert_model_parallel_size=4"),
    (["actor_config.expert_model_parallel_size=4", "actor_config.pipeline_model_parallel_size=2"], MOE,
     "actor_config.expert_model_parallel_size=4 does not divide the data-parallel size 2"),
    ([*EP2, "actor_config.ckpt_format=torch"], MOE, "actor_config.ckpt_format=torch with a mixture-of-experts model"),
    ([*EP2, "actor_config.moe_tp_extend_ep=true"], MOE, "actor_config.moe_tp_extend_ep=true: experts split over TP"),
    (["actor_config.backend=hf", *EP2], MOE, "actor_config.expert_model_parallel_size=2: tensor/pipeline/expert "
                                             "parallelism needs backend megatron"),
], ids=["dense", "tp", "experts", "dp", "legacy-format", "tp-extend-ep", "hf"])
def test_expert_parallel_layouts_that_cannot_run_are_refused(overrides, arch, start):
    assert refusal(overrides, arch=arch).startswith(start)


def test_distributed_optimizer_is_refused_on_cpu_only():
    message = refusal([*TP2, "actor_config.use_distributed_optimizer=true"])
    assert message == ("actor_config.use_distributed_optimizer=true: Megatron-Core's distributed optimizer needs CUDA "
                       f"buffers; set use_distributed_optimizer false on a CPU {MEGATRON}")
    assert "use_distributed_optimizer" not in inert([*TP2, "actor_config.use_distributed_optimizer=true"], "cuda")
    # hf: no effect, as before
    assert "actor_config.use_distributed_optimizer" in inert(["actor_config.use_distributed_optimizer=true"])


def test_megatron_needs_ray_worker_groups():
    message = refusal(["actor_config.backend=megatron", "rl_config.actor_resource.num_npus=1"])
    assert message.startswith("rl_config.actor_resource.num_npus=1: the megatron backend runs in Ray worker groups")


NOT_YET = [
    (["rl_config.ray_sharding=fsdp2"], "rl_config.ray_sharding=fsdp2"),
    ([*PPO, "critic_config.tensor_model_parallel_size=1"], "critic_config.tensor_model_parallel_size=1: colocated "
                                                          "roles"),
]


@pytest.mark.parametrize("overrides,start", NOT_YET, ids=[c[1] for c in NOT_YET])
def test_features_not_built_on_megatron_are_refused_by_key(overrides, start):
    lines = refusal([*TP2, *overrides]).splitlines()  # with every other refusal of the config, one per line
    assert any(line.startswith(start) and line.endswith(MEGATRON) for line in lines), lines


def test_a_reward_model_and_a_critic_directory_of_its_own_plan_on_megatron(tmp_path):
    """reward_config's reward model (in each replica's leader) and critic_config.save in a directory
    of its own (the critic's own Megatron checkpoints) are built on the megatron backend."""
    ppo = [*TP2, *PPO, "critic_config.tensor_model_parallel_size=2", f"critic_config.save={tmp_path / 'critic'}"]
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=ppo)
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    plan = build_plan(cfg, layout, ARCH, device="cpu")
    assert (plan.parallel.backend, plan.critic.save_dir) == ("megatron", str(tmp_path / "critic"))
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=[*TP2, f"reward_config.load={tmp_path}"])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    plan = build_plan(cfg, layout, ARCH, device="cpu")
    assert (plan.parallel.backend, plan.reward_model.path) == ("megatron", str(tmp_path))


def test_lora_on_megatron_plans_and_a_target_outside_a_megatron_layer_is_refused():
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=[*TP2, "actor_config.lora_target_modules=[q_proj,linear_fc1]"])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    plan = build_plan(cfg, layout, ARCH, device="cpu")
    assert (plan.parallel.backend, plan.parallel.tp, plan.lora) == ("megatron", 2, True)
    message = refusal([*TP2, "actor_config.lora_target_modules=[linear_qkv, lm_head]"])
    assert message.startswith("actor_config.lora_target_modules: 'lm_head' is not a linear of a Megatron layer; the "
                              "megatron backend adapts linear_qkv (q_proj, k_proj, v_proj); linear_proj (o_proj)")


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_offline_stages_plan_on_megatron(stage):
    pairs = ["megatron_training.is_pairwise_dataset=true"] if stage == "dpo" else []
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=[*TP2, f"megatron_training.stage={stage}", *pairs])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    par = build_plan(cfg, layout, ARCH, device="cpu").parallel
    assert (par.backend, par.tp, par.dp) == ("megatron", 2, 2)


def test_the_compatibility_table_lists_what_megatron_does_not_run_by_key():
    assert {FEATURES[row.feature].keys[0] for row in ROWS if row.backend == ("megatron",)} >= {
        "rl_config.ray_sharding", "actor_config.bf16", "actor_config.moe_tp_extend_ep"}


def test_offload_follows_the_hf_backends_rules():
    """As on the HF backend: on a CPU the optimizer state and the weights have nowhere to go
    (warned) while the gradients are freed; on CUDA the optimizer state and gradients offload and
    the weights move too, every rank's during the rollout (the leader samples from its own copy)."""
    offload = [f"generate_config.offload_train_{k}=true" for k in ("optimizer", "grad", "param")]
    warning = inert([*TP2, *offload])
    assert "offload_train_optimizer" in warning and "offload_train_grad" not in warning
    cfg = config([*TP2, *offload, "rl_config.offload_reference=true"])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    plan = build_plan(cfg, layout, ARCH, device="cpu")
    assert plan.offload_grads and not plan.offload_optimizer and plan.memory.reference == 0
    cfg = config([*TP2, *offload])
    layout, _ = check_run_config(cfg, device_type="cuda", arch=ARCH)
    plan = build_plan(cfg, layout, ARCH, device="cuda")
    assert plan.offload_grads and plan.offload_optimizer and plan.rollout.offload_weights
    assert plan.memory.off_during_rollout == ("weights", "optimizer", "gradients")


def test_the_plan_counts_the_gradients_the_loop_frees_off_during_the_rollout():
    """An HF run frees its gradients after each update (``OnPolicyTrainer.release_gradients``), in process
    and in Ray workers; a pipelined rollout runs through the update, Megatron keeps them, unless
    ``offload_train_grad``."""
    def off(overrides):
        cfg = config(overrides)
        layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
        return build_plan(cfg, layout, ARCH, device="cpu").memory.off_during_rollout

    one = ["rl_config.actor_resource.num_npus=1"]  # in process: no Ray workers
    assert off(one) == off([]) == ("gradients",)  # in process, and in two Ray workers
    assert off([*one, "rl_config.async_staleness=1"]) == () and off(["rl_config.async_staleness=1"]) == ()
    assert off(TP2) == ()
    assert off([*TP2, "generate_config.offload_train_grad=true"]) == ("gradients",)


def test_the_plan_counts_the_bf16_sampling_copy_off_during_a_synchronous_update():
    """A synchronous loop frees the native engine's bf16 sampling copy for the update
    (``NativeEngine.drop_sampling_weights``): the update's peak leaves it out; a pipelined rollout keeps it."""
    import dataclasses

    def memory(overrides):
        cfg = config(["rl_config.actor_resource.num_npus=1", *overrides])
        layout, _ = check_run_config(cfg, device_type="cuda", arch=ARCH)
        return build_plan(cfg, layout, ARCH, device="cuda").memory

    sync, pipelined = memory([]), memory(["rl_config.async_staleness=1"])
    assert sync.rollout_copy > 0 and sync.copy_freed_for_update and not pipelined.copy_freed_for_update
    held = dataclasses.replace(sync, copy_freed_for_update=False)
    assert held.update_peak - sync.update_peak == pytest.approx(sync.rollout_copy)
    assert held.rollout_peak == sync.rollout_peak  # the rollout samples from it


def test_virtual_stages_plan_on_megatron():
    cfg = config(["actor_config.pipeline_model_parallel_size=2", "actor_config.num_layers_per_virtual_pipeline_stage=1"])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    par = build_plan(cfg, layout, ARCH, device="cpu").parallel
    assert (par.backend, par.pp, par.vpp_layers, par.dp) == ("megatron", 2, 1, 2)


def test_bf16_is_honoured_on_cuda_and_named_on_cpu():
    """Megatron-Core's bf16 optimizer (fp32 main parameters) takes CUDA tensors only: on CUDA an
    explicit bf16 trains in bf16, on a CPU the run trains in float32 and the warning names the key."""
    cfg = config([*TP2, "actor_config.bf16=true"])
    layout, warnings = check_run_config(cfg, device_type="cuda", arch=ARCH)
    assert build_plan(cfg, layout, ARCH, device="cuda").train_dtype == "bfloat16"
    assert "actor_config.bf16" not in "".join(warnings)
    assert "actor_config.bf16" in inert([*TP2, "actor_config.bf16=true"])
    layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
    assert build_plan(cfg, layout, ARCH, device="cpu").train_dtype == "float32"


def test_roles_follow_the_actor_backend():
    message = refusal([*TP2, *PPO, "critic_config.backend=hf"])
    assert message.startswith("critic_config.backend=hf: the critic follows the actor's backend, megatron")


def test_sequence_parallel_is_honoured_with_tensor_parallelism_only():
    """On the megatron backend with TP > 1 on every device (the local spec's norms are replaced by
    ones that run it: posttrain.training.megatron.model.SequenceParallelNorm); without TP, or on the
    hf backend, it has no effect and is in the warning."""
    sp = "actor_config.sequence_parallel=true"
    for device in ("cpu", "cuda"):
        assert "sequence_parallel" not in inert([*TP2, sp], device)
    assert model_parallel(config([*TP2, sp])).sequence_parallel
    assert "sequence parallel" in model_parallel(config([*TP2, sp])).describe()
    assert not model_parallel(config(TP2)).sequence_parallel
    assert "actor_config.sequence_parallel" in inert(["actor_config.backend=megatron", sp])  # no TP: no effect
    assert "actor_config.sequence_parallel" in inert([sp])  # hf
    recompute = ["actor_config.recompute_method=uniform", "actor_config.recompute_num_layers=1"]
    assert "recompute" not in inert([*TP2, *recompute])
    assert "actor_config.recompute_method" in inert(["actor_config.recompute_method=uniform"])  # hf


# ---- what the plan derives -------------------------------------------------------------------------------------
def test_reads_are_dispatch_sizes_times_the_data_parallel_size():
    cfg = config(TP2)
    plan = build_plan(cfg, validate_run_config(cfg), ARCH)
    assert plan.workers == 4 and plan.parallel.dp == 2
    assert plan.reads["actor_update_dispatch_size"] == 2 * plan.dispatch_sizes["actor_update_dispatch_size"] == 32
    hf = config()
    plan = build_plan(hf, validate_run_config(hf), ARCH)
    assert plan.reads["actor_update_dispatch_size"] == 4 * plan.dispatch_sizes["actor_update_dispatch_size"] == 32


def test_memory_is_divided_by_the_model_split():
    hf = config()
    whole = build_plan(hf, validate_run_config(hf), ARCH).memory
    cfg = config(["actor_config.tensor_model_parallel_size=2", "actor_config.pipeline_model_parallel_size=2"])
    m = build_plan(cfg, validate_run_config(cfg), ARCH).memory
    assert (m.weights, m.gradients, m.optimizer) == pytest.approx((whole.weights / 4, whole.gradients / 4,
                                                                   whole.optimizer / 4))
    cfg = config([*TP2, "actor_config.use_distributed_optimizer=true"])  # DP 2 shares the optimizer state
    m = build_plan(cfg, validate_run_config(cfg), ARCH).memory
    assert m.weights == pytest.approx(whole.weights / 2) and m.optimizer == pytest.approx(whole.optimizer / 4)


def test_megatron_in_bf16_counts_bf16_weights_fp32_main_params_and_a_bf16_rollout_copy():
    """On a bf16 GPU Megatron-Core's Float16Module holds the weights in bf16 (2 bytes) and its
    optimizer an fp32 main copy beside the two moments (12 bytes); the gradients stay fp32
    (grad_reduce_in_fp32); the frozen reference is bf16 and the leader's rollout copy too."""
    cfg = config([*TP2, "rl_config.init_kl_coef=0.1", "generate_config.dtype=bfloat16"])
    fp32 = build_plan(cfg, validate_run_config(cfg), ARCH, device="cpu")  # megatron on a CPU trains in fp32
    bf16 = build_plan(cfg, validate_run_config(cfg), ARCH, device="cuda")
    assert (fp32.train_dtype, bf16.train_dtype, bf16.frozen_dtype, bf16.rollout_dtype) == \
        ("float32", "bfloat16", "bfloat16", "bfloat16")
    a, b, shard = fp32.memory, bf16.memory, ARCH.num_params() / 2
    assert (a.weights, a.gradients, a.optimizer, a.reference) == pytest.approx((4 * shard, 4 * shard, 8 * shard,
                                                                                4 * shard))
    assert (b.weights, b.gradients, b.optimizer, b.reference) == pytest.approx((2 * shard, 4 * shard, 12 * shard,
                                                                                2 * shard))
    assert b.rollout_copy == pytest.approx(2 * ARCH.num_params())  # the leader's whole copy, bf16


def test_a_model_whose_rollout_copy_does_not_fit_one_device_is_refused(monkeypatch):
    """The native rollout holds the whole model on each replica's leader: the seed's 7B model's fp32
    copy against a 16 GiB device is refused before anything loads (ignore_memory_estimate overrides)."""
    from posttrain.config import plan as plan_module

    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: 16 * 2**30)
    overrides = ["actor_config.use_distributed_optimizer=false"]
    with pytest.raises(ConfigError, match=r"the native rollout samples from a whole copy of the model in one process "
                                          r"\(the first rank of each data-parallel replica\): 28.4 GiB"):
        plan_module.resolve_plan(load_run_config("r1_zero_qwen25_7b", overrides=overrides), device="cpu")
    plan = plan_module.resolve_plan(load_run_config("r1_zero_qwen25_7b", overrides=[
        *overrides, "rl_config.ignore_memory_estimate=true"]), device="cpu")
    assert plan.memory.rollout_copy == pytest.approx(4 * plan.num_params)


def test_the_vllm_rollout_counts_its_share_per_device(monkeypatch):
    """With vLLM the leader's rollout is split over infer_tensor_parallel_size devices (fp32 on a CPU):
    the seed's 7B model at infer TP 4 fits the 16 GiB device that its native copy does not; at infer
    TP 1 it is refused, naming the key to raise."""
    import sys
    import types

    from posttrain.config import plan as plan_module
    from posttrain.config.memory import check_rollout_fits

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # the package, as installed
    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: 16 * 2**30)
    overrides = ["actor_config.use_distributed_optimizer=false", "rl_config.rollout_engine=vllm"]
    plan = plan_module.resolve_plan(load_run_config("r1_zero_qwen25_7b", overrides=[
        *overrides, "rl_config.ignore_memory_estimate=true"]), device="cpu")  # the rest of the run does not fit
    assert plan.rollout.vllm.tensor_parallel_size == 4
    assert plan.memory.rollout_copy == pytest.approx(4 * plan.num_params / 4)
    check_rollout_fits(plan)  # 7.1 GiB per device
    with pytest.raises(ConfigError, match=r"the vLLM rollout holds 1/1 of the model per device \(generate_config."
                                          r"infer_tensor_parallel_size=1\) in float32: 28.4 GiB .* raise "
                                          r"generate_config.infer_tensor_parallel_size"):
        plan_module.resolve_plan(load_run_config("r1_zero_qwen25_7b", overrides=[
            *overrides, "generate_config.infer_tensor_parallel_size=1"]), device="cpu")


def test_ckpt_format_is_named_on_the_hf_backend():
    """``ckpt_format`` is the megatron backend's: written with another value on the hf backend it is
    in the start-up warning (the hf backend saves HF directories); an unknown value is refused."""
    assert "ckpt_format" in inert(["actor_config.ckpt_format=torch"])
    assert "ckpt_format" not in inert([*TP2, "actor_config.ckpt_format=torch"])
    assert refusal(["actor_config.ckpt_format=zarr"]).startswith(
        "actor_config.ckpt_format='zarr': must be one of torch_dist, torch")


def test_expert_parallelism_divides_the_experts_in_the_memory_estimate():
    """A rank holds 1/EP of the experts: the weights shrink by (1 - 1/EP) of the experts' share."""
    estimates = {}
    for ep in (1, 2):
        cfg = config([f"actor_config.expert_model_parallel_size={ep}", "actor_config.backend=megatron"])
        layout, _ = check_run_config(cfg, device_type="cpu", arch=MOE)
        estimates[ep] = build_plan(cfg, layout, MOE, device="cpu").memory
    assert MOE.expert_params() == 4 * 3 * 64 * 32 * 4
    assert estimates[1].weights - estimates[2].weights == 4 * MOE.expert_params() / 2
    assert estimates[1].optimizer - estimates[2].optimizer == 8 * MOE.expert_params() / 2
