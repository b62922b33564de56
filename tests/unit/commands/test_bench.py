"""posttrain bench: FLOP counts by hand, the CPU meter, and one small end-to-end run of the CLI."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.commands import bench as bench_cmd
from tests.helpers.runs import forbid, run_cli, write_config


def _model():
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_forward_flops_by_hand():
    model = _model()
    # per layer: q 32x32 + k, v 32x16 + o 32x32 + gate/up/down 3 x 32x64 = 9216; 2 layers + lm_head 64x32
    assert bench_cmd.matmul_params(model) == 2 * 9216 + 2048
    # 2 N S B + 2 L d S^2 B with N = 20480, S = 10, B = 3, L = 2, d = 32
    assert bench_cmd.forward_flops(model, 10, 3) == 2 * 20480 * 30 + 2 * 2 * 32 * 100 * 3


def test_iteration_flops_phases():
    model = _model()
    metrics = {"prompt_length/mean": 4.0, "response_length/mean": 6.0, "timing/reference_model": 1.0}
    flops = bench_cmd.iteration_flops(model, metrics, num_prompts=2, n=3)
    # each of the 2 prompts once, plus the 6 responses over their 10-token contexts
    prefill_once = bench_cmd.forward_flops(model, 4, 2)
    full = prefill_once + bench_cmd.forward_flops(model, 10, 6) - bench_cmd.forward_flops(model, 4, 6)
    assert flops["rollout"] == pytest.approx(full) and flops["reference_model"] == pytest.approx(full)
    assert flops["update"] == pytest.approx(3 * full) and "old_log_p" not in flops
    assert flops["all"] == pytest.approx(5 * full)


def test_cpu_meter_counts_own_work():
    with bench_cmd.CpuMeter() as meter:
        x = torch.randn(256, 256)
        for _ in range(200):
            x = torch.tanh(x @ x)
    r = meter.result
    assert r["wall_s"] > 0 and r["own_cores"] > 0 and r["others_cores"] >= 0
    assert r["num_cpus"] == os.cpu_count()


def test_matmul_peak_positive():
    assert bench_cmd.matmul_peak("float32", "cpu", size=64, seconds=0.01) > 0


@pytest.mark.slow
def test_bench_cli_end_to_end(tiny_model_dir, tmp_path, sum_prompts):
    from posttrain.cli import main

    sum_prompts(tmp_path, tiny_model_dir)
    cfg = {
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 4, "seq_length": 48,
                              "train_iters": 1, "lr": 1e-4, "lr_decay_style": "constant",
                              "tokenizer_name_or_path": str(tiny_model_dir), "data_path": str(tmp_path / "rl" / "data"),
                              "dataset_additional_keys": ["labels"], "prompt_type": "default",
                              "reset_attention_mask": True},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "verifier_function": ["last_number"],
                      "verifier_weight": [1.0], "verifier_parallel": 0, "init_kl_coef": 0.01, "max_prompt_length": 48,
                      "output_dir": str(tmp_path / "run"), "use_remove_padding": True, "use_dynamic_bsz": True,
                      "max_packing_token_size": 64},
        "generate_config": {"max_model_len": 64, "max_num_seqs": 16, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}},
    }
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "bench.json"
    torch.set_num_threads(1)
    code = main(["bench", "--config-name", "bench", "--config-path", str(tmp_path), "--iters", "2", "--warmup", "1",
                 "--output", str(out), "--profile", str(tmp_path / "prof")])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["iters"] == 2 and len(report["iterations"]) == 3
    summary = report["summary"]
    for key in ("timing/rollout", "timing/reference_model", "timing/update", "timing/all", "e2e_tps", "mfu/update",
                "cpu/others_cores"):
        assert key in summary, key
    assert summary["timing/all"]["min"] <= summary["timing/all"]["median"] <= summary["timing/all"]["max"]
    assert report["matmul_peak_gflops"] > 0 and report["peak_memory_mib"] > 0
    profile = (tmp_path / "prof" / "profile.txt").read_text()  # the last iteration, op by op and per phase
    assert ("aten::mm" in profile or "mkldnn::_linear_pointwise" in profile)  # the BLAS or oneDNN (cpu_linear)
    assert "timing/update" in profile and "timing/rollout" in profile
    assert json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]
    assert report["run"]["cpu_linear"] in ("blas", "onednn") and report["run"]["train_dtype"] == report["train_dtype"]
    # benchmarks/floor_gap.py splits the profiled iteration's phases into matmuls, attention and the rest
    floor_gap = _floor_gap()
    split = floor_gap.analyse(tmp_path / "prof", report)
    last = report["iterations"][-1]
    assert set(split["phases"]) == {"rollout", "reference_model", "update"} and split["step"] == last["timing/all"]
    for phase, row in split["phases"].items():
        assert row["time"] == last[f"timing/{phase}"] and 0 < row["matmul"] < row["time"], (phase, row)
        assert row["rest"] == pytest.approx(row["time"] - row["matmul"] - row["attention"])
    assert split["phases"]["update"]["attention"] > 0  # the packed SDPA's forward and backward


def _floor_gap():
    import importlib
    import sys

    bench_dir = str(Path(__file__).resolve().parents[3] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        return importlib.import_module("floor_gap")
    finally:
        sys.path.remove(bench_dir)


def test_floor_gap_counts_kernels_inside_each_phase():
    """Leaf matmul and SDPA kernels count in the phase whose span holds their start; others do not count."""
    ev = [{"ph": "X", "name": "timing/rollout", "ts": 0, "dur": 100}, {"ph": "X", "name": "timing/update", "ts": 200,
                                                                      "dur": 100},
          {"ph": "X", "name": "aten::addmm", "ts": 10, "dur": 30}, {"ph": "X", "name": "aten::linear", "ts": 10, "dur": 35},
          {"ph": "X", "name": "mkldnn::_linear_pointwise", "ts": 50, "dur": 20},
          {"ph": "X", "name": "aten::_scaled_dot_product_flash_attention_for_cpu", "ts": 210, "dur": 7},
          {"ph": "X", "name": "aten::mm", "ts": 150, "dur": 40}, {"ph": "i", "name": "aten::mm", "ts": 220}]
    floor_gap = _floor_gap()
    spans = floor_gap.phase_spans({"traceEvents": ev})
    assert spans == {"rollout": (0, 100), "update": (200, 300)}
    got = floor_gap.kernel_times({"traceEvents": ev}, spans)
    assert got == {"rollout": {"matmul": pytest.approx(50e-6), "attention": 0.0},
                   "update": {"matmul": 0.0, "attention": pytest.approx(7e-6)}}


@pytest.mark.parametrize("flag,kind", [("--output", "dir"), ("--output", "file"), ("--profile", "file"),
                                       ("--profile", "dir_with_profile")])
def test_outputs_are_checked_before_the_work(mini_world, tmp_path, capsys, monkeypatch, flag, kind):
    """Probe X17: ``--output`` or ``--profile`` an existing directory or file."""
    target = tmp_path / "target"
    if kind == "dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "profile.txt").write_text("mine")
    forbid(monkeypatch, "posttrain.commands.bench:bench")
    code, err = run_cli(["bench", *write_config(mini_world, tmp_path / "run"), flag, str(target)], capsys)
    assert code == 2 and f"{flag} {target}" in err
    assert not [p for p in tmp_path.rglob(".*tmp*")]


def test_a_refused_override_is_named_not_the_yaml(mini_world, tmp_path, capsys):
    """Probes B1, B4: bench re-reads the config with its own overrides; a check that refuses a
    command-line value names that override, not the YAML file (mini_batch_size 8 > global batch 2)."""
    code, err = run_cli(["bench", *write_config(mini_world, tmp_path / "run"), "rl_config.mini_batch_size=8"], capsys)
    assert code == 2 and err.startswith("error: override 'rl_config.mini_batch_size=8': rl_config.mini_batch_size=8 is")
