"""Regression tests for the config cases of the reliability probe (/work/shared/reviews/reliability_probe.md,
section 1.1): each test is named after its case id. Every refusal exits 2 with one message that names the
culprit (file and line, override, or section.key and value), never a traceback, and ``plan`` refuses
what ``train`` refuses (both run :func:`posttrain.config.plan.resolve_plan`)."""

from __future__ import annotations

import copy
import json
import time

import pytest
import yaml

from posttrain.cli import main
from posttrain.paths import configs_dir

# The probe's world: configs/grpo_tiny_qwen2.yaml with the probe's changes (gbs 4, micro 16, n 4, mini 4).
ARCH = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": True}


@pytest.fixture
def world(tmp_path):
    """``tmp_path/cfg/grpo.yaml`` (the probe's grpo.yaml) and a model dir holding only a config.json."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(ARCH))
    data = yaml.safe_load((configs_dir() / "grpo_tiny_qwen2.yaml").read_text())
    data["megatron_training"].update(tokenizer_name_or_path=str(tmp_path / "model"), global_batch_size=4,
                                     train_iters=3, save_interval=1, data_path=str(tmp_path / "data/rl/data"),
                                     prompt_type_path=str(configs_dir() / "tiny_templates.json"))
    data["actor_config"].update(micro_batch_size=16, load=str(tmp_path / "model"), save=str(tmp_path / "ckpt"))
    data["rl_config"].update(output_dir=str(tmp_path / "out"), n_samples_per_prompt=4, mini_batch_size=4,
                             use_tensorboard=False, device="cpu")
    data["rl_config"].pop("eval_data_path")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "grpo.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return tmp_path


def yaml_lines(world) -> list[str]:
    return (world / "cfg" / "grpo.yaml").read_text().splitlines()


def line_of(world, text: str) -> int:
    return next(i for i, line in enumerate(yaml_lines(world), 1) if line.strip().startswith(text))


def write(world, name: str, text: str) -> None:
    (world / "cfg" / f"{name}.yaml").write_text(text)


def run(capsys, world, *overrides, command="plan", name="grpo"):
    """``posttrain <command> --config-path WORLD/cfg --config-name NAME overrides``: (exit code, stdout,
    stderr). The world has no dataset and no weights: plan checks the config alone (--config-only;
    the files are checked in tests/unit/commands/test_plan_files.py)."""
    flags = ["--config-only"] if command == "plan" else []
    code = main([command, *flags, "--config-path", str(world / "cfg"), "--config-name", name, *overrides])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def refused(capsys, world, *overrides, name="grpo", command="plan") -> str:
    code, out, err = run(capsys, world, *overrides, name=name, command=command)
    assert code == 2, f"expected exit 2, got {code}: {out}{err}"
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one message
    return err


# ---- YAML -----------------------------------------------------------------------------------------------
def test_C3_unclosed_quote_points_at_the_line_it_opens(capsys, world):
    lines = yaml_lines(world)
    stage = line_of(world, "stage:")
    lines[stage - 1] = lines[stage - 1].replace("ray_grpo", '"ray_grpo')
    write(world, "quote", "\n".join(lines) + "\n")  # never closed: the scanner's context mark
    err = refused(capsys, world, name="quote")
    assert f"line {stage}, column" in err and "never closed" in err
    lines.append('extra: ["x"]')  # closed far below, by the next quote: the parser fails there
    write(world, "quote2", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="quote2")
    assert f"quoted string that starts at line {stage}" in err and "closing quote missing" in err


def test_C3_parser_error_says_the_cause_may_be_above(capsys, world):
    write(world, "bracket", "megatron_training:\n  stage: ray_grpo\n  x: {a: 1\n  y: 2\nrl_config:\n  z: 1\n")
    err = refused(capsys, world, name="bracket")
    assert "malformed YAML at line" in err and "may start earlier" in err


def test_C4_duplicate_key_names_both_lines(capsys, world):
    lines = yaml_lines(world)
    first = line_of(world, "train_iters:")
    lines.insert(first, "  train_iters: 1000")
    write(world, "dupkey", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="dupkey")
    assert "dupkey.yaml" in err and "duplicate key 'train_iters' in megatron_training" in err
    assert f"lines {first} and {first + 1}" in err


def test_C5_duplicate_section_names_both_lines(capsys, world):
    lines = yaml_lines(world)
    first = line_of(world, "rl_config:")
    lines += ["rl_config:", "  n_samples_per_prompt: 4"]
    write(world, "dupsec", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="dupsec")
    assert f"duplicate section 'rl_config' at lines {first} and {len(lines) - 1}" in err


def test_C4_duplicate_key_in_an_override_value(capsys, world):
    err = refused(capsys, world, "generate_config.sampling_config={max_tokens: 8, max_tokens: 9}")
    assert "override 'generate_config.sampling_config=" in err and "duplicate key 'max_tokens'" in err


def test_C8_non_utf8_names_file_and_offset(capsys, world):
    text = (world / "cfg" / "grpo.yaml").read_bytes()
    (world / "cfg" / "nonutf8.yaml").write_bytes(b"# caf\xff\n" + text)
    err = refused(capsys, world, name="nonutf8")
    assert "nonutf8.yaml: not UTF-8" in err and "0xff at offset 5 (line 1)" in err


SHAPES = [  # (YAML text or None, overrides, what the message names)
    ("megatron_training: 3\n", [], "megatron_training must be a mapping"),  # C11
    (None, ["megatron_training=3"], "override 'megatron_training=3': megatron_training must be a mapping"),
    ("megatron_training: [1, 2]\n", [], "megatron_training must be a mapping"),  # C12
    ("megatron_training:\n  stage: ray_grpo\nprofiler_config: 3\n", [], "profiler_config must be a mapping"),  # C13
    ("megatron_training:\n  stage: ray_grpo\nprofiler_config:\n  integrated: 3\n", [],
     "profiler_config.integrated: must be a mapping"),
    ("defaults: 3\n", [], "defaults must be a list"),  # C14
    (None, ["defaults=3"], "override 'defaults=3': defaults must be a list"),
    ("model: [1]\n", [], "model must be a mapping of model names"),  # C16
    (None, ["model.foo=1"], "model.foo must be a mapping of architecture keys"),
]


@pytest.mark.parametrize("text,overrides,message", SHAPES, ids=[s[2][:30] + str(i) for i, s in enumerate(SHAPES)])
def test_C11_C16_sections_of_the_wrong_shape_exit_2(capsys, world, text, overrides, message):
    name = "grpo"
    if text is not None:
        write(world, "shape", text)
        name = "shape"
    err = refused(capsys, world, *overrides, name=name)
    assert message in err
    if text is not None:
        assert "shape.yaml line" in err


BOMB = ("megatron_training:\n  stage: ray_grpo\n  lora_target_modules:\n"
        "    - &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"    - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefghi", "bcdefghij")))


def test_C18_alias_bomb_is_refused_without_expanding_it(capsys, world):
    write(world, "bomb", BOMB)  # 9^10 leaves in a few hundred bytes
    start = time.monotonic()
    err = refused(capsys, world, name="bomb")
    assert time.monotonic() - start < 10
    assert "bomb.yaml" in err and "expands to more than 100,000 values" in err


def test_C18_recursive_alias_and_override_bombs(capsys, world):
    write(world, "rec", "megatron_training:\n  lora_target_modules: &a [*a]\n")
    assert "recursive" in refused(capsys, world, name="rec")
    value = "[" + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi"))
    err = refused(capsys, world, "megatron_training.lora_target_modules=[&a [x,x,x,x,x,x,x,x,x], " + value[1:] + "]")
    assert "override 'megatron_training.lora_target_modules=" in err and "expands to more than" in err


@pytest.mark.parametrize("override,message", [
    ("megatron_training.global_batch_size=abc", "override 'megatron_training.global_batch_size=abc': "
                                                "megatron_training.global_batch_size: Input should be a valid integer"),
    ("megatron_training.global_batch_size=1.5", "megatron_training.global_batch_size: Input should be a valid "
                                                "integer, got a number with a fractional part"),
], ids=["C19", "C20"])
def test_C19_C20_type_errors_name_the_section_written(capsys, world, override, message):
    err = refused(capsys, world, override)
    assert message in err and "actor_config" not in err


def test_C19_type_error_in_yaml_names_file_and_line(capsys, world):
    lines = yaml_lines(world)
    gbs = line_of(world, "global_batch_size:")
    lines[gbs - 1] = "  global_batch_size: abc"
    write(world, "wt_mt", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="wt_mt")
    assert f"wt_mt.yaml line {gbs}: megatron_training.global_batch_size: Input should be a valid integer" in err


@pytest.mark.parametrize("override,message", [
    ("profiler_config.foo=1", "profiler_config: The key: foo is missing"),  # C62
    ("profiler_config.integrate={profile: false}", "Did you mean 'integrated'?"),
    ("rl_config.integrated_mode_config.ref_model_load_pth=x",  # C63
     "rl_config.integrated_mode_config: The key: ref_model_load_pth is missing"),
    ("model.foo={num_layer: 3}", "model.foo: The key: num_layer is missing"),  # C64
], ids=["C62", "C62_typo", "C63", "C64"])
def test_C62_C64_unknown_keys_are_refused(capsys, world, override, message):
    err = refused(capsys, world, override)
    assert message in err and f"override '{override}'" in err


def test_C62_unknown_profiler_key_in_yaml_names_the_line(capsys, world):
    lines = yaml_lines(world) + ["profiler_config:", "  profile_typo: true"]
    write(world, "prof", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="prof")
    assert f"prof.yaml line {len(lines)}: profiler_config: The key: profile_typo is missing" in err


def test_C64_model_yaml_with_an_unknown_key(capsys, world):
    (world / "cfg" / "model").mkdir()
    (world / "cfg" / "model" / "m1.yaml").write_text("m1:\n  num_layer: 2\n")
    write(world, "withmodel", "defaults:\n  - model:\n      - m1\n" + "\n".join(yaml_lines(world)) + "\n")
    err = refused(capsys, world, name="withmodel")
    assert "m1.yaml: model.m1: The key: num_layer is missing" in err and "Did you mean 'num_layers'" in err


def test_C73_unknown_section_from_an_override_blames_the_override(capsys, world):
    err = refused(capsys, world, "a.b.c=1")
    assert "override 'a.b.c=1': unknown section 'a'" in err and "grpo.yaml" not in err


# ---- impossible numbers: the one check, so plan and train agree ------------------------------------------
SIZES = [
    ("megatron_training.global_batch_size=-4", "megatron_training.global_batch_size=-4: must be an integer >= 1"),
    ("megatron_training.global_batch_size=0", "megatron_training.global_batch_size=0: must be an integer >= 1"),
    ("actor_config.micro_batch_size=0", "actor_config.micro_batch_size=0: must be an integer >= 1"),
    ("actor_config.micro_batch_size=-16", "actor_config.micro_batch_size=-16: must be an integer >= 1"),
    ("rl_config.mini_batch_size=0", "rl_config.mini_batch_size=0: must be an integer >= 1"),
    ("rl_config.mini_batch_size=-4", "rl_config.mini_batch_size=-4: must be an integer >= 1"),
    ("rl_config.n_samples_per_prompt=0", "rl_config.n_samples_per_prompt=0: must be an integer >= 1"),
    ("rl_config.n_samples_per_prompt=-1", "rl_config.n_samples_per_prompt=-1: must be an integer >= 1"),
    ("actor_config.tensor_model_parallel_size=0", "actor_config.tensor_model_parallel_size=0: must be"),
    ("generate_config.infer_tensor_parallel_size=0", "generate_config.infer_tensor_parallel_size=0: must be"),
    ("rl_config.ref_dispatch_size=0", "rl_config.ref_dispatch_size=0: must be an integer >= 1"),
]


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("override,message", SIZES, ids=[s[0] for s in SIZES])
def test_C26_C33_zero_or_negative_sizes_exit_2(capsys, world, override, message, command):
    err = refused(capsys, world, override, command=command)
    assert message in err


def test_C26_C33_size_in_yaml_names_file_and_line(capsys, world):
    lines = yaml_lines(world)
    gbs = line_of(world, "global_batch_size:")
    lines[gbs - 1] = "  global_batch_size: 0"
    write(world, "gbs0", "\n".join(lines) + "\n")
    err = refused(capsys, world, name="gbs0")
    assert f"gbs0.yaml line {gbs}: megatron_training.global_batch_size=0: must be an integer >= 1" in err


NUMBERS = [
    ("actor_config.lr=0", "actor_config.lr=0: must be a finite number > 0 (the peak learning rate)"),  # C34
    ("actor_config.lr=-1", "actor_config.lr=-1: must be a finite number > 0"),
    ("actor_config.lr=.inf", "actor_config.lr=inf: must be a finite number > 0"),  # C35
    ("actor_config.weight_decay=.nan", "actor_config.weight_decay=nan: must be a finite number >= 0"),  # C36
    ("actor_config.weight_decay=-1", "actor_config.weight_decay=-1: must be a finite number >= 0"),
    ("megatron_training.min_lr=.nan", "megatron_training.min_lr=nan: must be a finite number >= 0"),
    ("actor_config.clip_grad=.nan", "actor_config.clip_grad=nan: must be a finite number"),
    ("actor_config.adam_beta2=1.5", "actor_config.adam_beta2=1.5: must be a number in [0, 1)"),
    ("megatron_training.train_iters=0", "megatron_training.train_iters=0: must be an integer >= 1 (iterations "
                                        "to run)"),  # C37
    ("megatron_training.train_iters=-1", "megatron_training.train_iters=-1: must be an integer >= 1"),  # C38
    ("rl_config.epochs=0", "rl_config.epochs=0: must be an integer >= 1"),  # C39
    ("rl_config.epochs=-1", "rl_config.epochs=-1: must be an integer >= 1"),
    ("megatron_training.seq_length=0", "megatron_training.seq_length=0: must be an integer >= 1"),  # C40
    ("megatron_training.seq_length=-5", "megatron_training.seq_length=-5: must be an integer >= 1"),
    ("generate_config.sampling_config.max_tokens=0",  # C41
     "generate_config.sampling_config.max_tokens=0: must be an integer >= 1"),
    ("generate_config.sampling_config.max_tokens=-1",
     "generate_config.sampling_config.max_tokens=-1: must be an integer >= 1"),
    ("generate_config.sampling_config.temperature=-1",  # C42
     "generate_config.sampling_config.temperature=-1: must be a finite number >= 0 (0: greedy)"),
    ("generate_config.sampling_config.top_p=2",
     "generate_config.sampling_config.top_p=2: must be a number in (0, 1]"),
    ("rl_config.verifier_timeout=0", "rl_config.verifier_timeout=0: must be a finite number > 0 (seconds one sample "
                                     "may take)"),  # C43
    ("rl_config.verifier_timeout=-1", "rl_config.verifier_timeout=-1: must be a finite number > 0"),
    ("rl_config.verifier_timeout=.nan", "rl_config.verifier_timeout=nan: must be a finite number > 0"),
    ("rl_config.verifier_parallel=-2", "rl_config.verifier_parallel=-2: must be an integer >= 0 (verifier worker "
                                       "processes; 0 scores inline)"),
    ("megatron_training.save_interval=-1", "megatron_training.save_interval=-1: must be an integer >= 0"),  # C45
    ("rl_config.max_prompt_length=0", "rl_config.max_prompt_length=0: must be an integer >= 1"),  # C46
    ("rl_config.max_prompt_length=-1", "rl_config.max_prompt_length=-1: must be an integer >= 1"),
    ("rl_config.actor_resource.num_npus=-1", "rl_config.actor_resource.num_npus=-1: must be an integer >= 0"),  # C47
    ("rl_config.verifier_weight=[.nan]", "rl_config.verifier_weight[0]=nan: must be a finite number >= 0"),  # C50
    ("rl_config.verifier_weight=[-1]", "rl_config.verifier_weight[0]=-1: must be a finite number >= 0"),
]


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("override,message", NUMBERS, ids=[n[0] for n in NUMBERS])
def test_C34_C50_impossible_numbers_exit_2(capsys, world, override, message, command):
    assert message in refused(capsys, world, override, command=command)


def test_C45_negative_save_interval_refused_0_means_only_the_final_save(capsys, world):
    err = refused(capsys, world, "megatron_training.save_interval=-1")
    assert "megatron_training.save_interval=-1: must be an integer >= 0 (save every N iterations; 0 or null: only " \
           "the final save)" in err
    code, out, _ = run(capsys, world, "megatron_training.save_interval=0")
    assert code == 0 and "valid" in out and "memory per worker process" in out


def test_C92_mini_batch_larger_than_global_batch_names_both_keys(capsys, world):
    err = refused(capsys, world, "rl_config.mini_batch_size=8")
    assert "rl_config.mini_batch_size=8 is larger than megatron_training.global_batch_size=4" in err
    assert "dispatch_size" not in err


@pytest.mark.parametrize("device,message", [
    ("tpu", "rl_config.device='tpu': unknown device; use auto"),
    ("cuda:99", "rl_config.device=cuda:99:"),
], ids=["C95_tpu", "C96_cuda_index"])
def test_C95_C96_device_is_named(capsys, world, device, message):
    err = refused(capsys, world, f"rl_config.device={device}")
    assert message in err and "bf16" not in err


def test_C95_C96_cuda_without_a_cuda_device(capsys, world, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("plan", "train"):
        err = refused(capsys, world, "rl_config.device=cuda", "megatron_training.bf16=true",
                      "generate_config.dtype=bfloat16", command=command)
        assert "rl_config.device=cuda: there is no CUDA device here" in err and "use auto or cpu" in err


def test_C86_max_tokens_above_max_model_len_exit_2(capsys, world):
    err = refused(capsys, world, "generate_config.sampling_config.max_tokens=1000000000")
    assert ("generate_config.sampling_config.max_tokens=1000000000 is larger than generate_config.max_model_len=32"
            in err)
    assert "max_prompt_length" in err


def test_C88_C90_memory_above_the_machine(capsys, world, monkeypatch):
    import posttrain.config.plan as plan_mod
    from posttrain.config.run import load_run_config

    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: None)
    total = plan_mod.resolve_plan(load_run_config("grpo", world / "cfg")).memory.total  # per worker process
    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: int(total / 1.5))
    code, out, _ = run(capsys, world)
    assert code == 0 and "warning: the plan's memory estimate" in out and "may be killed" in out
    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: int(total / 3))
    for command in ("plan", "train"):  # train finds the architecture as plan does
        err = refused(capsys, world, command=command)
        assert "3.0x this machine's memory" in err
        assert "rl_config.ignore_memory_estimate: true" in err
    code, out, _ = run(capsys, world, "rl_config.ignore_memory_estimate=true")
    assert code == 0 and "warning: the plan's memory estimate" in out
    # the probe's C88 / C90 on a 4 GiB machine
    monkeypatch.setattr("posttrain.config.memory.machine_memory_bytes", lambda: 4 * plan_mod.GIB)
    refused(capsys, world, "rl_config.n_samples_per_prompt=100000", "actor_config.micro_batch_size=100000")
    refused(capsys, world, "generate_config.sampling_config.max_tokens=10000000",
            "megatron_training.seq_length=10000000", "generate_config.max_model_len=10000000")


def test_C90_train_gets_the_architecture_as_plan_does(world):
    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import load_run_config

    plan = resolve_plan(load_run_config("grpo", world / "cfg"))  # what train(cfg) calls
    assert plan.arch is not None and plan.arch.num_layers == 2 and plan.memory is not None


def test_C98_missing_prompt_type_path_names_the_path(capsys, world):
    err = refused(capsys, world, f"megatron_training.prompt_type_path={world / 'nosuch.json'}")
    assert f"megatron_training.prompt_type_path={world / 'nosuch.json'}: no such file" in err


def test_K26_no_save_warns_that_nothing_will_be_saved(capsys, world):
    code, out, _ = run(capsys, world, "actor_config.save=null")
    assert code == 0 and "warning: actor_config.save is not set: nothing will be saved" in out
    code, out, _ = run(capsys, world)
    assert "nothing will be saved" not in out


@pytest.mark.parametrize("command", ["plan", "train"])
def test_C82_unknown_verifier_fails_in_plan_too(capsys, world, command):
    err = refused(capsys, world, "rl_config.verifier_function=[nosuch]", command=command)
    assert "Unknown verifier 'nosuch'" in err and "rl_config.verifier_function" in err
    err = refused(capsys, world, "rl_config.verifier_modules=[nosuch_module]", command=command)
    assert "rl_config.verifier_modules: cannot import 'nosuch_module'" in err


def test_check_order_sizes_before_the_seed_rules():
    """A zero size never reaches the seed's divisibility rules (no ZeroDivisionError) in the Python API."""
    from posttrain.config.check import check_run_config
    from posttrain.config.run import run_config_from_dict
    from posttrain.errors import ConfigError

    base = {"megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 64,
                                  "micro_batch_size": 2},
            "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4},
            "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 64}}
    for key in ("megatron_training.global_batch_size", "megatron_training.micro_batch_size",
                "rl_config.mini_batch_size", "rl_config.n_samples_per_prompt"):
        with pytest.raises(ConfigError, match=rf"{key}=0: must be an integer >= 1"):  # refused as it loads
            check_run_config(run_config_from_dict(copy.deepcopy(base), overrides=[f"{key}=0"]))
