"""The one compatibility table (posttrain.config.compat): every row is exercised by a config that
triggers it, through the one config check, and its message names the keys; every refusal of a config
is reported at once, one per line; the rows without effect are named in the start-up warning."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.compat import DIMENSIONS, FEATURES, ROW_IDS, ROWS, Setup, check_compat, refusals, setup_of
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch

GRPO = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "actor_resource": {"num_npus": 1}},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}
ARCH = ModelArch(model_type="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=256, tie_embeddings=True)
DPO = ["megatron_training.stage=dpo", "megatron_training.is_pairwise_dataset=true"]
KTO = ["megatron_training.stage=dpo", "actor_config.dpo_loss_type=kto"]
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.micro_batch_size=2"]
DAPO = ["megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true",
        "rl_config.filter_groups_metric=base_acc", "rl_config.filter_groups_train_batch_size=4"]
TP2 = ["actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_npus=2"]
RAY = ["rl_config.actor_resource.num_npus=2"]
VLLM = ["rl_config.rollout_engine=vllm"]
OTHER = ["rl_config.rollout_engine=mine"]  # a registered engine that is neither native nor vLLM
LORA = ["actor_config.lora_target_modules=[linear_qkv]"]
SEPARATE = ["rl_config.use_integrated_worker=false"]  # the seed lets ref_config be set only then
TURNS = ["rl_config.multi_turn_enable=true", "rl_config.async_engine=true", "rl_config.max_total_response_length=1024"]
ASYNC = ["rl_config.async_staleness=1"]
WORKER = ["rl_config.separate_rollout_worker=true"]
SEP_REF = ["rl_config.use_integrated_worker=false", "rl_config.reference_resource.num_npus=1"]
PARTIAL = ["rl_config.partial_rollout_max_split=2"]
TQ = ["rl_config.data_strategy=queue"]  # the seed's spelling of tq
SPEC = ["generate_config.num_speculative_tokens=4"]
OFFLOAD_PARAM = ["generate_config.offload_train_param=true"]
GRAPHS = ["generate_config.enforce_eager=false"]
ENV = ["rl_config.env_config={type: verifiers, id: my_tasks}"]  # posttrain.envs
MSPROBE = ["msprobe_config.msprobe=true"]
TRUNC = ["rl_config.truncated_sampling_logprobs=true"]
JUDGE = ["rl_config.judge_path=/models/judge"]
MM = ["rl_config.is_multimodal=true"]
MM_FROZEN = [*MM, "rl_config.freeze_vision_tower=true"]
TEACHER = ["rl_config.teacher_model=/models/teacher"]

# row id -> (overrides that turn the row on, device); a new row needs its example here
EXAMPLES: dict[str, tuple[list[str], str]] = {
    "megatron-one-process": (["actor_config.backend=megatron"], "cpu"),
    "skip-train-offline": ([*DPO, "actor_config.skip_train=true"], "cpu"),
    "refer-model-iter-not-dpo": (["actor_config.refer_model_iter=2"], "cpu"),
    "pretrained-checkpoint-critic": ([*PPO, "critic_config.pretrained_checkpoint=/ckpt"], "cpu"),
    "skip-train-without-eval": (["actor_config.skip_train=true"], "cpu"),
    "skip-train-critic": ([*PPO, "rl_config.eval_data_path=/data/eval", "critic_config.skip_train=true"], "cpu"),
    "megatron-distributed-optimizer-cpu": ([*TP2, "actor_config.use_distributed_optimizer=true"], "cpu"),
    "megatron-bf16-cpu": ([*TP2, "actor_config.bf16=true"], "cpu"),
    "megatron-share-prompt-prefix": ([*TP2, "rl_config.share_prompt_prefix=true"], "cpu"),
    "megatron-compile-regions": ([*TP2, "rl_config.compile_regions=true"], "cpu"),
    "compile-regions-cuda": (["rl_config.compile_regions=true"], "cuda"),
    "compile-regions-auto-ray": ([*RAY, "rl_config.compile_regions=auto"], "cpu"),
    "compile-regions-fsdp2": ([*RAY, "rl_config.ray_sharding=fsdp2", "rl_config.compile_regions=true"], "cpu"),
    "megatron-ref_config.tensor_model_parallel_size": ([*TP2, *SEPARATE, "ref_config.tensor_model_parallel_size=1"],
                                                       "cpu"),
    "megatron-ref_config.pipeline_model_parallel_size": ([*TP2, *SEPARATE, "ref_config.tensor_model_parallel_size=2",
                                                          "ref_config.pipeline_model_parallel_size=2"], "cpu"),
    "megatron-ref_config.num_layers_per_virtual_pipeline_stage": (
        [*TP2, *SEPARATE, "ref_config.tensor_model_parallel_size=2",
         "ref_config.num_layers_per_virtual_pipeline_stage=1"], "cpu"),
    "megatron-critic_config.tensor_model_parallel_size": ([*TP2, *PPO, "critic_config.tensor_model_parallel_size=1"],
                                                          "cpu"),
    "megatron-critic_config.pipeline_model_parallel_size": (
        [*TP2, *PPO, "critic_config.tensor_model_parallel_size=2", "critic_config.pipeline_model_parallel_size=2"],
        "cpu"),
    "megatron-critic_config.num_layers_per_virtual_pipeline_stage": (
        [*TP2, *PPO, "critic_config.tensor_model_parallel_size=2",
         "critic_config.num_layers_per_virtual_pipeline_stage=1"], "cpu"),
    "megatron-moe-tp-extend-ep": ([*TP2, "actor_config.moe_tp_extend_ep=true"], "cpu"),
    "megatron-fsdp2": ([*TP2, "rl_config.ray_sharding=fsdp2"], "cpu"),
    "lora-critic": ([*PPO, "critic_config.lora_target_modules=[q_proj]"], "cpu"),
    "offload-param-lora": ([*OFFLOAD_PARAM, *LORA], "cuda"),
    "offload-param-fsdp2": ([*OFFLOAD_PARAM, *RAY, "rl_config.ray_sharding=fsdp2"], "cuda"),
    "offload-param-async": ([*OFFLOAD_PARAM, *ASYNC], "cuda"),
    "offload-param-rollout-worker": ([*OFFLOAD_PARAM, *WORKER], "cuda"),
    "shared-backbone-offload-reference": ([*LORA, "rl_config.share_backbone=true", "rl_config.offload_reference=true"],
                                          "cpu"),
    "shared-backbone-ref-model": ([*LORA, "rl_config.share_backbone=true",
                                   "rl_config.integrated_mode_config.ref_model_load_path=/models/ref"], "cpu"),
    "vllm-infer_pipeline_parallel_size": ([*VLLM, "generate_config.infer_pipeline_parallel_size=2"], "cpu"),
    "vllm-infer_expert_parallel_size": ([*VLLM, "generate_config.infer_expert_parallel_size=2"], "cpu"),
    "vllm-num_scheduler_steps": ([*VLLM, "generate_config.num_scheduler_steps=4"], "cpu"),
    "vllm-torchair_graph": ([*VLLM, "generate_config.torchair_graph=true"], "cpu"),
    "vllm-speculation": ([*VLLM, *SPEC], "cpu"),
    "vllm-ascend_scheduler_config_enabled": ([*VLLM, "generate_config.ascend_scheduler_config_enabled=true"], "cpu"),
    "vllm-ray-tensor-parallel": ([*VLLM, *RAY, "generate_config.infer_tensor_parallel_size=2"], "cpu"),
    "async-offline": ([*DPO, *ASYNC], "cpu"),
    "async-engine": ([*ASYNC, *OTHER], "cpu"),
    "async-lora": ([*ASYNC, *LORA], "cpu"),
    "rollout_worker-offline": ([*DPO, *WORKER], "cpu"),
    "rollout_worker-ray": ([*WORKER, *RAY], "cpu"),
    "rollout_worker-engine": ([*WORKER, *OTHER], "cpu"),
    "rollout_worker-megatron": ([*WORKER, *TP2], "cpu"),
    "rollout_worker-lora": ([*WORKER, *LORA], "cpu"),
    "partial-engine": ([*PARTIAL, *OTHER], "cpu"),
    "partial-dynamic-sampling": ([*DAPO, *PARTIAL, "rl_config.mini_batch_size=2"], "cpu"),
    "async-engine-engine": (["rl_config.async_engine=true", *OTHER], "cpu"),
    "graphs-per-request": ([*GRAPHS, "rl_config.async_engine=true"], "cuda"),
    "multi-turn-stage": ([*DPO, "rl_config.multi_turn_enable=true"], "cpu"),
    "multi-turn-engine": ([*TURNS, *OTHER], "cpu"),
    "multi-turn-partial": ([*TURNS, *PARTIAL], "cpu"),
    "turn-credit-single-turn": (["rl_config.turn_credit=turn"], "cpu"),
    "env-offline": ([*ENV, *DPO], "cpu"),
    "env-ray": ([*ENV, *RAY], "cpu"),
    "env-multi_turn": ([*ENV, *TURNS], "cpu"),
    "env-dynamic_sampling": ([*ENV, *DAPO], "cpu"),
    "env-async": ([*ENV, *ASYNC], "cpu"),
    "env-rollout_worker": ([*ENV, *WORKER], "cpu"),
    "env-separated": ([*ENV, *SEP_REF], "cpu"),
    "env-partial": ([*ENV, *PARTIAL], "cpu"),
    "env-turns-engine": (["rl_config.env_config={type: openenv, id: m:E}", *VLLM], "cuda"),
    "env-turns-ppo": (["rl_config.env_config={type: openenv, id: m:E}", *PPO], "cpu"),
    "env-data-path": ([*ENV, "actor_config.data_path=some/prefix"], "cpu"),
    "env-eval-data": ([*ENV, "rl_config.eval_data_path=some/prefix"], "cpu"),
    "env-verifiers": ([*ENV, "rl_config.verifier_function=[acc]"], "cpu"),
    "turn-credit-estimator": ([*TURNS, "rl_config.turn_credit=turn", "rl_config.adv_estimator=rloo"], "cpu"),
    "turn-credit-megatron": ([*TURNS, *TP2, "rl_config.turn_credit=turn"], "cpu"),
    "speculation-per-request": ([*SPEC, "rl_config.async_engine=true"], "cpu"),
    "speculation-graphs": ([*SPEC, *GRAPHS], "cuda"),
    "speculation-partial-ray": ([*SPEC, *PARTIAL, *RAY], "cpu"),
    "num-threads-ray": (["rl_config.num_threads=2", *RAY], "cpu"),
    "profiler-ray": (["profiler_config.integrated.profile=true", *RAY], "cpu"),
    "msprobe-ray": ([*MSPROBE, *RAY], "cpu"),
    "msprobe-infer-offline": ([*MSPROBE, "msprobe_config.actor_infer_dump=true", *DPO], "cpu"),
    "msprobe-critic-no-critic": ([*MSPROBE, "msprobe_config.critic_train_dump=true"], "cpu"),
    "msprobe-reference-sft": ([*MSPROBE, "msprobe_config.reference_dump=true", "megatron_training.stage=sft"], "cpu"),
    "msprobe-separated": ([*MSPROBE, *SEP_REF], "cpu"),
    "msprobe-infer-engine": ([*MSPROBE, "msprobe_config.actor_infer_dump=true", *VLLM], "cpu"),
    "msprobe-infer-graphs": ([*MSPROBE, "msprobe_config.actor_infer_dump=true", *GRAPHS], "cuda"),
    "msprobe-infer-async": ([*MSPROBE, "msprobe_config.actor_infer_dump=true", *ASYNC], "cpu"),
    "msprobe-infer-rollout-worker": ([*MSPROBE, "msprobe_config.actor_infer_dump=true", *WORKER], "cpu"),
    "dp-batch-balance-one-process": (["rl_config.use_dp_batch_balance=true"], "cpu"),
    "ref-config": ([*SEPARATE, "ref_config.micro_batch_size=2"], "cpu"),
    "separated-megatron": ([*SEP_REF, *TP2], "cpu"),
    "separated-offline": ([*DPO, *SEP_REF], "cpu"),
    "separated-rollout-worker": ([*SEP_REF, *WORKER], "cpu"),
    "separated-share-backbone": ([*SEP_REF, *LORA, "rl_config.share_backbone=true"], "cpu"),
    "separated-critic-save": ([*PPO, "rl_config.use_integrated_worker=false", "rl_config.critic_resource.num_npus=1"],
                              "cpu"),
    "blocking-integrated": (["rl_config.blocking=false"], "cpu"),
    "reward-model-offline": ([*DPO, "reward_config.load=/models/rm"], "cpu"),
    "judge-offline": ([*DPO, *JUDGE], "cpu"),
    "judge-ray": ([*JUDGE, *RAY], "cpu"),
    "judge-megatron": ([*JUDGE, *TP2], "cpu"),
    "judge-async": ([*JUDGE, *ASYNC], "cpu"),
    "judge-rollout-worker": ([*JUDGE, *WORKER], "cpu"),
    "judge-env": ([*JUDGE, *ENV], "cpu"),
    "judge-multimodal": ([*JUDGE, *MM], "cpu"),
    "self-judge-not-native": (["rl_config.judge_path=policy", *VLLM], "cpu"),
    "kto-megatron": ([*KTO, *TP2], "cpu"),
    "kto-ray": ([*KTO, *RAY], "cpu"),
    "transfer-queue-offline": ([*DPO, *TQ], "cpu"),
    "transfer-queue-partial": ([*TQ, *PARTIAL], "cpu"),
    "transfer-queue-shards": (["rl_config.transfer_queue_data_shard_num=2"], "cpu"),
    "truncated-logprobs-offline": ([*DPO, *TRUNC], "cpu"),
    "truncated-logprobs-megatron": ([*TP2, *TRUNC], "cpu"),
    "truncated-logprobs-ray": ([*TRUNC, *RAY], "cpu"),
    "truncated-logprobs-engine": ([*TRUNC, *OTHER], "cpu"),
    "truncated-logprobs-share-backbone": ([*TRUNC, *LORA, "rl_config.share_backbone=true"], "cpu"),
    "truncated-logprobs-greedy": ([*TRUNC, "generate_config.sampling_config.temperature=0"], "cpu"),
    "truncated-logprobs-untruncated": ([*TRUNC, "generate_config.sampling_config.top_k=-1"], "cpu"),
    "truncated-logprobs-vllm-min-p": ([*TRUNC, *VLLM, "generate_config.sampling_config.min_p=0.1"], "cpu"),
    "mm-megatron-split": ([*MM_FROZEN, "actor_config.pipeline_model_parallel_size=2",
                           "rl_config.actor_resource.num_npus=2"], "cpu"),
    "mm-megatron-tower": ([*MM, *TP2], "cpu"),
    "mm-megatron-reuse": ([*MM_FROZEN, "rl_config.reuse_image_embeds=true", *TP2], "cpu"),
    "mm-megatron-lora": ([*MM_FROZEN, *LORA, *TP2], "cpu"),
    "mm-megatron-bf16": ([*MM_FROZEN, *TP2], "cuda"),
    "mm-megatron-video": ([*MM_FROZEN, *TP2, "generate_config.limit_mm_video_per_prompt=1"], "cpu"),
    "mm-megatron-partial": ([*MM_FROZEN, *TP2, *PARTIAL], "cpu"),
    "mm-megatron-async": ([*MM_FROZEN, *TP2, *ASYNC], "cpu"),
    "mm-engine": ([*MM, *VLLM], "cpu"),
    "mm-fsdp2-tower": ([*MM, *RAY, "rl_config.ray_sharding=fsdp2"], "cpu"),
    "mm-fsdp2-bf16": ([*MM_FROZEN, *RAY, "rl_config.ray_sharding=fsdp2"], "cuda"),
    "mm-fsdp2-lora": ([*MM_FROZEN, *LORA, *RAY, "rl_config.ray_sharding=fsdp2"], "cpu"),
    "mm-stage": ([*MM, *PPO], "cpu"),
    "mm-per_request": ([*MM, "rl_config.async_engine=true"], "cpu"),
    "mm-reward_model": ([*MM, "reward_config.load=/models/rm"], "cpu"),
    "mm-rollout_worker": ([*MM, *WORKER], "cpu"),
    "mm-separated": ([*MM, *SEP_REF], "cpu"),
    "mm-transfer_queue": ([*MM, *TQ], "cpu"),
    "mm-env": ([*MM, *ENV], "cpu"),
    "mm-lora-tower": ([*MM, *LORA], "cpu"),
    "mm-reuse-trained-tower": ([*MM, "rl_config.reuse_image_embeds=true"], "cpu"),
    "mm-sft-reuse": ([*MM_FROZEN, "rl_config.reuse_image_embeds=true", "megatron_training.stage=sft"], "cpu"),
    "mm-reuse-ref-model": ([*MM_FROZEN, "rl_config.reuse_image_embeds=true",
                            "rl_config.integrated_mode_config.ref_model_load_path=/models/ref"], "cpu"),
    "mm-eval": ([*MM, "rl_config.eval_data_path=/data/eval"], "cpu"),
    "mm-key-alone": (["rl_config.freeze_vision_tower=true"], "cpu"),
    "mm-embeds-dispatch": ([*MM_FROZEN, "rl_config.actor_image_embeds_dispatch_size=4"], "cpu"),
    "mm-video-alone": (["generate_config.limit_mm_video_per_prompt=1"], "cpu"),
    "teacher-model-offline": ([*DPO, *TEACHER], "cpu"),
    "teacher-model-ppo": ([*PPO, *TEACHER], "cpu"),
    "teacher-model-megatron": ([*TP2, *TEACHER], "cpu"),
    "teacher-model-separated": ([*TEACHER, *SEP_REF], "cpu"),
    "distill-without-teacher": (["rl_config.distill_coef=0.5"], "cpu"),
    "teacher-model-multimodal": ([*TEACHER, *MM], "cpu"),
    "teacher-model-env": ([*TEACHER, *ENV], "cpu"),
    "teacher-model-multi-turn": ([*TEACHER, *TURNS], "cpu"),
}
# rows an earlier rule of the one check answers first, with its own message (the row documents the fact)
ANSWERED_FIRST = {"vllm-infer_pipeline_parallel_size": "pipeline_parallel for vllm is not supported yet ! "}


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def config(overrides):
    return run_config_from_dict(copy.deepcopy(GRPO), overrides=list(overrides))


def names_its_keys(row, line: str) -> bool:
    """The row's line names the feature's first key in full and every other key of its features by name."""
    features = [FEATURES[row.feature], *([FEATURES[row.with_]] if row.with_ else [])]
    keys = [key for f in features for key in f.keys]
    return keys[0] in line and all(key.split(".")[-1] in line for key in keys)


def test_every_row_has_an_example():
    assert set(EXAMPLES) == set(ROW_IDS), "give each row of posttrain.config.compat.ROWS a triggering config here"
    assert len(ROW_IDS) == len(ROWS), "row ids must be unique"


@pytest.mark.parametrize("row_id", list(ROW_IDS))
def test_each_row_triggers_naming_its_keys(row_id):
    row, (overrides, device) = ROW_IDS[row_id], EXAMPLES[row_id]
    cfg = config(overrides)
    setup = setup_of(cfg, device)
    assert row.applies(cfg, setup), f"{row_id}: the example does not turn the row on"
    line = row.text(cfg, setup)
    assert names_its_keys(row, line), line
    if row.effect == "no effect":  # named in the one start-up warning, and the run goes on
        assert line not in refusals(cfg, setup)
        _, warnings = check_run_config(cfg, device_type=device, arch=ARCH)
        assert any(FEATURES[row.feature].label(cfg) in w for w in warnings if w.startswith("keys with no effect"))
        return
    with pytest.raises(ConfigError) as err:
        check_run_config(cfg, device_type=device, arch=ARCH)
    lines = str(err.value).splitlines()
    if row_id in ANSWERED_FIRST:  # the seed's rule comes first, the row's refusal with the others
        assert lines[0] == ANSWERED_FIRST[row_id]
    assert line in lines, str(err.value)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.where() or r.with_])
def test_each_row_needs_its_combination(row_id, monkeypatch):
    """In another value of a dimension the row names, or without its other feature, the row is off."""
    row, (overrides, device) = ROW_IDS[row_id], EXAMPLES[row_id]
    cfg = config(overrides)
    setup = setup_of(cfg, device)
    for dimension, values in row.where().items():
        elsewhere = next(v for v in DIMENSIONS[dimension] if v not in values)
        assert not row.applies(cfg, dataclasses.replace(setup, **{dimension: elsewhere})), (dimension, elsewhere)
    if row.with_ is not None:
        monkeypatch.setitem(FEATURES, row.with_, dataclasses.replace(FEATURES[row.with_], active=lambda c: False))
        assert not row.applies(cfg, setup)


def test_every_refusal_of_a_config_is_reported_at_once_one_per_line():
    cfg = config([*ASYNC, *LORA, *PARTIAL, *VLLM, *RAY, "rl_config.num_threads=2"])  # partial rollout runs on Ray
    with pytest.raises(ConfigError) as err:
        check_run_config(cfg, device_type="cpu", arch=ARCH)
    lines = str(err.value).splitlines()
    table = refusals(cfg, setup_of(cfg, "cpu"))
    assert [line.split(" ")[0] for line in table] == [
        "rl_config.async_staleness", "rl_config.num_threads=2"]
    assert [line for line in lines if line in table] == table  # with the other checks' refusals (vllm here)


def test_features_alone_pass_the_table():
    for overrides in ([], TEACHER, [*TEACHER, "rl_config.distill_mode=mixed", *VLLM], [*TEACHER, *RAY], ASYNC, PARTIAL, LORA, VLLM, TQ, [*TQ, "rl_config.transfer_queue_data_shard_num=2"], SPEC, WORKER, TP2, RAY, [*PARTIAL, *VLLM], [*TURNS, *VLLM],
                      ["rl_config.async_engine=true", *VLLM], ["rl_config.async_engine=true", *VLLM, *GRAPHS],
                      [*ASYNC, *VLLM], [*ASYNC, *PARTIAL, *VLLM], [*ASYNC, *TURNS, *VLLM], [*WORKER, *VLLM],
                      [*WORKER, *ASYNC, *VLLM], [*ASYNC, *VLLM, *RAY], [*ASYNC, *PARTIAL, *VLLM, *RAY], [*ASYNC, *TP2],
                      [*ASYNC, *PARTIAL, *TP2], MM, [*MM_FROZEN, *LORA, "rl_config.reuse_image_embeds=true",
                                                     "rl_config.actor_image_embeds_dispatch_size=4",
                                                     "rl_config.vit_forward_micro_batch_size=2"],
                      [*MM, *RAY, "generate_config.limit_mm_video_per_prompt=1"], [*MM, *RAY, *PARTIAL, *ASYNC],
                      [*MM, *RAY, "megatron_training.stage=sft"]):
        cfg = config(overrides)
        for device in ("cpu", "cuda"):
            check_compat(cfg, setup_of(cfg, device))


def test_the_setup_of_a_config():
    assert setup_of(config([]), "cpu") == Setup("hf", "native", "process", "cpu", "grpo",
                                                "no tensor/pipeline/context/expert parallelism asked")
    setup = setup_of(config([*TP2, *VLLM]), "cuda")
    assert (setup.backend, setup.engine, setup.placement, setup.device) == ("megatron", "vllm", "ray-ddp", "cuda")
    assert setup_of(config([*RAY, "rl_config.ray_sharding=fsdp2"]), "cpu").placement == "ray-fsdp2"
    assert setup_of(config(["rl_config.rollout_engine=mine"]), "cpu").engine == "other"


@pytest.mark.parametrize("kw", [{"feature": "no_such_feature"}, {"with_": "no_such_feature"},
                                {"placement": ("ray",)}, {"effect": "warned"}])
def test_a_row_with_an_unknown_name_is_an_error(kw):
    from posttrain.config.compat import Row

    with pytest.raises(ValueError, match="compatibility row x: unknown"):
        Row(**{"id": "x", "feature": "lora", "message": "{setting}", **kw})


def test_a_vlm_on_the_megatron_backend_trains_with_its_images_and_from_its_hf_directory(tmp_path):
    """Qwen2.5-VL's language model is mapped with is_multimodal only (Qwen3-VL never); a Megatron
    checkpoint as load resumes where its iteration holds the trained VLM (``hf/``) and finetune is off,
    else it is refused, naming what to load instead."""
    from posttrain.config.backend import check_mapped

    vlm, qwen3_vl = dataclasses.replace(ARCH, model_type="qwen2_5_vl"), dataclasses.replace(ARCH, model_type="qwen3_vl")
    check_mapped(config([*MM_FROZEN, *TP2]), vlm)
    with pytest.raises(ConfigError, match="set rl_config.is_multimodal: true"):
        check_mapped(config(TP2), vlm)
    with pytest.raises(ConfigError, match="qwen3_vl is not mapped to Megatron-Core"):
        check_mapped(config([*MM_FROZEN, *TP2]), qwen3_vl)
    (tmp_path / "iter_0000002/mp_rank_00").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"actor_config.load=.*no iteration that a multimodal.*iter_XXXXXXX/hf"):
        check_mapped(config([*MM_FROZEN, *TP2, f"actor_config.load={tmp_path}"]), vlm)  # a text run's: no hf/
    (tmp_path / "iter_0000002/hf").mkdir()
    (tmp_path / "iter_0000002/hf/config.json").write_text(
        '{"model_type": "qwen2_5_vl", "vision_config": {}, "text_config": {}}', encoding="utf-8")
    check_mapped(config([*MM_FROZEN, *TP2, f"actor_config.load={tmp_path}"]), vlm)  # a multimodal run's: resumes
    with pytest.raises(ConfigError, match=r"finetune: true .* is not built"):
        check_mapped(config([*MM_FROZEN, *TP2, f"actor_config.load={tmp_path}", "actor_config.finetune=true"]), vlm)
