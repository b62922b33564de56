"""Value ranges declared on the config fields (``F(..., ge=0, finite=True)``, ``Literal`` choices):
``posttrain plan`` refuses a value outside them as it loads the config, naming the key (with its file
line, or the override), the value and the range."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from posttrain.cli import main
from posttrain.config.fields import ValueRange, fmt_value, value_range
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.config.sections import GenerateConfig, Resource, RLConfig, SamplingConfig
from posttrain.errors import ConfigError
from posttrain.paths import configs_dir

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}
# where each section class is written in a config
PATHS = {MegatronConfig: "megatron_training", RLConfig: "rl_config", Resource: "rl_config.actor_resource",
         GenerateConfig: "generate_config", SamplingConfig: "generate_config.sampling_config"}
ISSUE_34 = [("rl_config.clip_ratio=-0.5", "rl_config.clip_ratio=-0.5: must be a finite number >= 0"),
            ("rl_config.entropy_coeff=-3", "rl_config.entropy_coeff=-3: must be a finite number >= 0"),
            ("rl_config.init_kl_coef=-1", "rl_config.init_kl_coef=-1: must be a finite number >= 0")]


def plan(capsys, *args: str) -> tuple[int, str]:
    """``posttrain plan ARGS`` in this process: (exit code, stderr)."""
    code = main(["plan", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("override,message", ISSUE_34, ids=[o for o, _ in ISSUE_34])
def test_plan_refuses_a_value_outside_its_range(capsys, override, message):
    code, err = plan(capsys, "--config-name", "grpo_tiny_qwen2", override)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: {message} (")  # the key, the value, the range, then what the key means


def test_plan_names_the_file_line_of_a_value_outside_its_range(capsys, tmp_path):
    data = yaml.safe_load((configs_dir() / "grpo_tiny_qwen2.yaml").read_text())
    data["rl_config"]["clip_ratio"] = -0.5
    text = yaml.safe_dump(data, sort_keys=False)
    (tmp_path / "neg.yaml").write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.strip().startswith("clip_ratio:"))
    code, err = plan(capsys, "--config-path", str(tmp_path), "--config-name", "neg")
    assert code == 2
    assert f"neg.yaml line {line}: rl_config.clip_ratio=-0.5: must be a finite number >= 0" in err


def test_plan_refuses_every_value_outside_its_range_one_per_line(capsys):
    code, err = plan(capsys, "--config-name", "grpo_tiny_qwen2", *(o for o, _ in ISSUE_34))
    lines = err.removeprefix("error: ").splitlines()
    assert code == 2 and [line.split(":")[0] for line in lines] == [o for o, _ in ISSUE_34]


def test_the_ends_of_a_range_load():
    cfg = load_run_config("grpo_tiny_qwen2", overrides=["rl_config.clip_ratio=0", "rl_config.entropy_coeff=0",
                                                        "rl_config.init_kl_coef=0", "rl_config.gamma=1"])
    assert (cfg.rl.clip_ratio, cfg.rl.entropy_coeff, cfg.rl.init_kl_coef, cfg.rl.gamma) == (0, 0, 0, 1)


def _declared() -> list[tuple[str, ValueRange]]:
    """(``section.key``, its declared range) of every field with one; ``[0]`` marks a list's items."""
    out = []
    for cls, path in PATHS.items():
        for name in cls.model_fields:
            declared = value_range(cls, name)
            item = value_range(cls, name, 0)
            if declared is not None and declared.declared:
                out.append((f"{path}.{name}", declared))
            elif item is not None and item.declared:
                out.append((f"{path}.{name}[0]", item))
    return out


def _outside(declared: ValueRange):
    if declared.choices:
        return "no_such_choice"
    step = 1 if declared.integer else 0.5
    if declared.ge is not None:
        return declared.ge - step
    if declared.gt is not None:
        return declared.gt
    if declared.le is not None:
        return declared.le + step
    if declared.lt is not None:
        return declared.lt
    return math.nan


DECLARED = _declared()


def test_the_ranges_the_issue_names_are_declared():
    keys = {key for key, _ in DECLARED}
    assert {"rl_config.clip_ratio", "rl_config.entropy_coeff", "rl_config.init_kl_coef", "rl_config.verifier_weight[0]",
            "megatron_training.lr", "generate_config.sampling_config.top_p", "rl_config.ray_sharding"} <= keys
    assert len(keys) > 80


@pytest.mark.parametrize("key,declared", DECLARED, ids=[k for k, _ in DECLARED])
def test_every_declared_range_refuses_by_key_value_and_range(key, declared):
    value = _outside(declared)
    nan = isinstance(value, float) and math.isnan(value)
    written = f"[{fmt_value(value)}]" if key.endswith("[0]") else ".nan" if nan else str(value)
    override = f"{key.removesuffix('[0]')}={written}"
    with pytest.raises(ConfigError) as err:
        run_config_from_dict(copy.deepcopy(BASE), overrides=[override])
    shown = repr(value) if declared.choices else fmt_value(value)
    assert str(err.value) == f"{key}={shown}: must be {declared.describe()}" + (
        f" ({declared.note})" if declared.note else "")


@pytest.mark.parametrize("described,declared", [
    ("an integer >= 1", ValueRange(ge=1, integer=True)),
    ("a finite number > 0", ValueRange(gt=0, finite=True)),
    ("a finite number", ValueRange(finite=True)),
    ("a number in [0, 1)", ValueRange(ge=0, lt=1)),
    ("a number in (0, 1]", ValueRange(gt=0, le=1)),
    ("a number <= 2.5", ValueRange(le=2.5)),
    ("one of ddp, fsdp2", ValueRange(choices=("ddp", "fsdp2"))),
    ("one of left, right or null", ValueRange(choices=("left", "right", None))),
])
def test_ranges_read_as_words(described, declared):
    assert declared.describe() == described


def test_choices_match_the_names_the_run_knows():
    import typing

    from posttrain.algo.rollout_correction import LEVELS, MODES
    from posttrain.training.optim import lr_decay_styles

    def choices(cls, name):
        return set(value_range(cls, name).choices) - {None}

    assert choices(RLConfig, "rollout_correction") == set(MODES)
    assert choices(RLConfig, "rollout_correction_level") == set(LEVELS)
    assert choices(MegatronConfig, "lr_decay_style") == set(lr_decay_styles())
    assert choices(MegatronConfig, "backend") == {"hf", "megatron"}
    assert typing.get_args(RLConfig.model_fields["ray_sharding"].annotation) == ("ddp", "fsdp2")


@pytest.mark.parametrize("name", [n for n in SamplingConfig.model_fields if value_range(SamplingConfig, n).declared])
def test_sampling_ranges_are_the_rollouts(name):
    """The rollout checks its sampling parameters itself (SamplingParams.validate): the fields declare
    the same ranges, so a config never reaches that check with a value it refuses."""
    from posttrain.rollout.base import SamplingParams

    declared = value_range(SamplingConfig, name)
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**{name: _outside(declared)}).validate()
    inside = declared.ge if declared.ge is not None else declared.le
    SamplingParams(**{name: inside}).validate()
    run_config_from_dict(copy.deepcopy(BASE), overrides=[f"generate_config.sampling_config.{name}={inside}"])
