"""``posttrain plan --target``: a plan for hardware this machine is not (posttrain.config.target), and
every refusal of a config reported at once (posttrain.config.check.Refusals). In process, no model
is loaded: the shipped configs' model yamls size the models."""

from __future__ import annotations

import pytest

from posttrain.config.memory import estimate_memory
from posttrain.config.plan import GIB, resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.target import FORMS, parse_target
from posttrain.errors import ConfigError

DPO = "dpo_qwen3_30b_a3b"  # 16 devices, TP 4 x PP 2 x EP 2, use_distributed_optimizer: true


def plan_cli(argv, capsys) -> tuple[int, str, str]:
    from posttrain.cli import main

    code = main(["plan", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


@pytest.mark.parametrize("text,why", [("tpu:64GiB", "unknown device 'tpu'"), ("npu:64", "the size 64 has no unit"),
                                      ("cuda:80", "the size 80 has no unit"), ("cuda", "no size"),
                                      ("cuda:80 gigs", "cannot read the size '80 gigs'"), ("80GiB", "unknown device")])
def test_a_bad_target_is_refused_naming_the_accepted_forms(capsys, text, why):
    code, _, err = plan_cli(["--config-name", DPO, "--target", text], capsys)
    assert code == 2 and why in err and FORMS in err, err


def test_nodes_without_a_target_are_refused(capsys):
    code, _, err = plan_cli(["--config-name", DPO, "--nodes", "2"], capsys)
    assert code == 2 and "--nodes and --devices-per-node describe a --target cluster" in err


def test_sizes_and_units():
    assert parse_target("cuda:80GiB").memory_bytes == 80 * GIB
    assert parse_target("npu:64GB").memory_bytes == 64 * 10**9
    assert parse_target("cpu:1.5TiB").memory_bytes == int(1.5 * 1024 * GIB)
    assert parse_target("CUDA:512mib").memory_bytes == 512 * 1024**2
    with pytest.raises(ConfigError, match="--devices-per-node=0: must be at least 1"):
        parse_target("cuda:80GiB", 1, 0)


def test_a_cuda_target_runs_the_checks_of_cuda_here_on_a_cpu(capsys):
    """The distributed optimizer is refused on a CPU and honoured on CUDA; the target decides, not this machine."""
    code, _, err = plan_cli(["--config-name", DPO, "--config-only"], capsys)  # this machine: a CPU
    assert code == 2 and "use_distributed_optimizer=true: Megatron-Core's distributed optimizer needs CUDA" in err
    code, out, err = plan_cli(["--config-name", DPO, "--target", "cuda:80GiB", "--nodes", "2", "--devices-per-node",
                               "8"], capsys)
    assert code == 0, err
    assert "valid for cuda:80GiB" in out and "cuda, bfloat16 training, bfloat16 rollout" in out
    assert "target cuda:80GiB: 80.00 GiB per device, 2 node(s) x 8 device(s)" in out
    assert "memory per device (one worker process each)" in out and "distributed optimizer" in out
    plan = resolve_plan(load_run_config(DPO), target=parse_target("cuda:80GiB", 2, 8))
    total = estimate_memory(load_run_config(DPO), plan, plan.arch).total
    [line] = [line for line in out.splitlines() if line.strip().startswith("total ")]
    assert line.split()[-2] == f"{total / GIB:.2f}"  # the printed total is the estimate's


def test_an_npu_target_says_it_is_a_capacity_check(capsys):
    code, out, _ = plan_cli(["--config-name", DPO, "--target", "npu:64GiB"], capsys)
    assert code == 0
    assert "16 device(s), the config's count" in out
    assert "an npu target is a capacity check" in out and "plans it as CUDA devices of that memory (bf16)" in out


def test_a_cpu_target_plans_in_float32_and_refuses_the_cuda_only_keys():
    cfg = load_run_config(DPO)
    with pytest.raises(ConfigError, match="use_distributed_optimizer=true"):
        resolve_plan(cfg, target=parse_target("cpu:4TiB"))
    plan = resolve_plan(load_run_config("grpo_tiny_qwen2"), target=parse_target("cpu:1GiB"))
    assert (plan.device, plan.train_dtype, plan.rollout_dtype) == ("cpu", "float32", "float32")


def test_the_device_count_must_be_the_configs(capsys):
    code, _, err = plan_cli(["--config-name", DPO, "--target", "cuda:80GiB", "--nodes", "3",
                             "--devices-per-node", "8"], capsys)
    assert code == 2
    assert ("--nodes 3 x --devices-per-node 8 = 24 devices, but the config uses 16 "
            "(rl_config.actor_resource.num_npus=16)") in err
    code, _, err = plan_cli(["--config-name", DPO, "--target", "cuda:80GiB", "--nodes", "3"], capsys)
    assert code == 2 and "the config's 16 devices (rl_config.actor_resource.num_npus=16) cannot be spread" in err


def test_the_memory_per_device_is_compared_with_the_target():
    """Above the target's device: refused, with the estimate's number; ignore_memory_estimate makes it a warning."""
    cfg = load_run_config(DPO)
    plan = resolve_plan(cfg, target=parse_target("cuda:80GiB"))
    need = plan.memory.total
    small = f"cuda:{int(need / GIB) - 1}GiB"
    with pytest.raises(ConfigError) as err:
        resolve_plan(load_run_config(DPO), target=parse_target(small))
    assert f"the plan's memory estimate, {need / GIB:,.2f} GiB per device" in str(err.value)
    assert f"above the target's {int(need / GIB) - 1:,.2f} GiB (--target {small})" in str(err.value)
    plan = resolve_plan(load_run_config(DPO, overrides=["rl_config.ignore_memory_estimate=true"]),
                        target=parse_target(small))
    assert any(w.startswith("the plan's memory estimate") for w in plan.warnings)


def test_rl_config_device_must_agree_with_the_target():
    cfg = load_run_config(DPO, overrides=["rl_config.device=cpu"])
    with pytest.raises(ConfigError, match=r"rl_config.device=cpu but --target cuda:80GiB plans for cuda devices"):
        resolve_plan(cfg, target=parse_target("cuda:80GiB"))


def test_every_refusal_is_listed_at_once_one_per_line(monkeypatch):
    """Keys refused on their own, compatibility rows, the rollout copy and the memory: one error, a
    line each naming its key; train (commands.train.train_config) refuses with the same lines."""
    overrides = ["rl_config.blocking=false", "rl_config.data_strategy=tq",
                 "rl_config.partial_rollout_max_split=2", "rl_config.guarantee_order=false",
                 "rl_config.filter_groups_enable=true", "rl_config.rollout_engine=native"]  # native: a whole copy
    cfg = load_run_config("dapo_qwen3_32b_A3", overrides=overrides)  # 16 devices, TP 8 x PP 2
    with pytest.raises(ConfigError) as err:
        resolve_plan(cfg, target=parse_target("cuda:48GiB", 1, 16))  # the 32B model's bf16 copy: 61 GiB
    lines = str(err.value).splitlines()
    starts = ["rl_config.blocking: false overlaps",  # a key refused on its own (a feature)
              "rl_config.partial_rollout_max_split > 1 with DAPO's dynamic sampling",  # compat
              "rl_config.data_strategy: tq with rl_config.partial_rollout_max_split > 1",  # compat
              "the native rollout samples from a whole copy", "the plan's memory estimate"]  # the memory
    for start in starts:
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
    assert len(lines) == len(starts)

    from posttrain.commands import train

    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("train must refuse before it runs"))
    with pytest.raises(ConfigError) as here:  # on this CPU: the distributed optimizer too, the memory of this machine
        train.train_config(load_run_config("dapo_qwen3_32b_A3", overrides=[*overrides, "rl_config.device=cpu"]))
    here_lines = str(here.value).splitlines()
    on_cpu = set(starts[:4])  # offload_train_param has no effect on a CPU: warned, not refused
    assert on_cpu <= {next((s for s in starts if line.startswith(s)), line) for line in here_lines}
    assert any(line.startswith("megatron_training.use_distributed_optimizer=true") for line in here_lines)


def test_a_target_does_not_ask_this_machine_for_the_vllm_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed here
    overrides = ["rl_config.rollout_engine=vllm", "generate_config.offload_train_param=false",
                 "generate_config.infer_tensor_parallel_size=1"]
    with pytest.raises(ConfigError, match="needs the vllm package, which is not installed here"):
        resolve_plan(load_run_config("grpo_qwen25_7b_A3", overrides=[*overrides, "rl_config.device=cpu"]))
    cfg = load_run_config("grpo_qwen25_7b_A3", overrides=[*overrides, "rl_config.ignore_memory_estimate=true"])
    plan = resolve_plan(cfg, target=parse_target("cuda:80GiB", 2, 8))
    assert any("needs the vllm package on the target machine" in w for w in plan.warnings)
    assert plan.rollout.vllm is not None
