"""Loading, merging, overrides and strict keys."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.config.loader import apply_overrides, read_yaml, resolve_config_file
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.errors import ConfigError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def cfg_dir(tmp_path):
    write(tmp_path, "model/m1.yaml", """
        m1:
          num_layers: 2
          hidden_size: 64
          num_attention_heads: 4
          padded_vocab_size: 128
          swiglu: true
        """)
    write(tmp_path, "small.yaml", """
        defaults:
          - model:
              - m1
        megatron_training:
          model: m1
          global_batch_size: 4
          seq_length: 256
          stage: ray_grpo
          hidden_size: 96
        actor_config:
          model: m1
          micro_batch_size: 2
          lr: 1e-6
        rl_config:
          n_samples_per_prompt: 4
          mini_batch_size: 2
        generate_config:
          infer_tensor_parallel_size: 1
          sampling_config:
            max_tokens: 32
        """)
    return tmp_path


def test_defaults_pull_model_yaml_and_role_merge(cfg_dir):
    cfg = load_run_config("small", cfg_dir)
    assert cfg.models["m1"]["num_layers"] == 2
    # actor_config's `model: m1` applies the architecture after megatron_training, so the
    # architecture's hidden_size (64) wins over megatron_training's 96, as in the seed.
    assert cfg.actor.hidden_size == 64
    assert cfg.actor.num_layers == 2 and cfg.actor.swiglu is True
    assert cfg.actor.global_batch_size == 4 and cfg.actor.micro_batch_size == 2
    assert cfg.actor.lr == pytest.approx(1e-6)  # YAML 1.1 reads 1e-6 as a string; it is converted
    assert cfg.stage == "grpo"
    assert cfg.generate.sampling_config.max_tokens == 32
    assert cfg.generate.sampling_config.top_k == 50  # default kept


def test_config_name_with_or_without_suffix(cfg_dir):
    assert resolve_config_file("small", cfg_dir) == resolve_config_file("small.yaml", cfg_dir)


def test_overrides_are_converted_to_the_field_type(cfg_dir):
    cfg = load_run_config("small", cfg_dir, ["rl_config.n_samples_per_prompt=16", "actor_config.lr=2e-5",
                                             "rl_config.verifier_function=[acc,format]",
                                             "rl_config.verifier_weight=[1.0,0.5]"])
    assert cfg.rl.n_samples_per_prompt == 16
    assert cfg.actor.lr == pytest.approx(2e-5)
    assert cfg.rl.verifier_function == ["acc", "format"]


def test_override_creates_missing_section():
    out = apply_overrides({}, ["rl_config.actor_resource.num_npus=4"])
    assert out == {"rl_config": {"actor_resource": {"num_npus": 4}}}


def test_wrong_type_names_the_key(cfg_dir):
    with pytest.raises(ConfigError, match=r"rl_config\.n_samples_per_prompt.*'abc'"):
        load_run_config("small", cfg_dir, ["rl_config.n_samples_per_prompt=abc"])


def test_unknown_key_names_section_and_suggests(cfg_dir):
    with pytest.raises(ConfigError) as err:
        load_run_config("small", cfg_dir, ["rl_config.n_sample_per_prompt=3"])
    msg = str(err.value)
    assert "rl_config" in msg and "The key: n_sample_per_prompt is missing" in msg
    assert "Did you mean 'n_samples_per_prompt'" in msg


def test_unknown_nested_key(cfg_dir):
    with pytest.raises(ConfigError, match="generate_config.sampling_config.*topk"):
        load_run_config("small", cfg_dir, ["generate_config.sampling_config.topk=3"])


def test_unknown_section(cfg_dir):
    with pytest.raises(ConfigError, match="unknown section 'rl_cfg'"):
        load_run_config("small", cfg_dir, ["rl_cfg.x=1"])


def test_dashes_become_underscores(cfg_dir):
    cfg = load_run_config("small", cfg_dir, ["rl_config.max-prompt-length=64"])
    assert cfg.rl.max_prompt_length == 64


def test_resource_aliases():
    for key in ("num_npus", "num_gpus", "num_devices"):
        cfg = run_config_from_dict({"megatron_training": {"stage": "ray_grpo"},
                                    "rl_config": {"actor_resource": {key: 4}}})
        assert cfg.rl.actor_resource.num_npus == 4


def test_malformed_yaml_gives_line_and_column(tmp_path):
    path = write(tmp_path, "bad.yaml", "rl_config:\n  a: [1, 2\n  b: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: malformed YAML at line \d+, column \d+"):
        read_yaml(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config_file("absent", tmp_path)


def test_unknown_model_in_section(cfg_dir):
    with pytest.raises(ConfigError, match="model 'm2' is not loaded"):
        load_run_config("small", cfg_dir, ["actor_config.model=m2"])


def test_unknown_stage(cfg_dir):
    cfg = load_run_config("small", cfg_dir, ["megatron_training.stage=ray_foo"])
    with pytest.raises(ConfigError, match="unknown stage 'ray_foo'"):
        _ = cfg.stage


def test_megatron_only_keys_are_listed(cfg_dir):
    cfg = load_run_config("small", cfg_dir, ["megatron_training.sequence_parallel=true",
                                             "megatron_training.use_fused_rmsnorm=true"])
    assert cfg.ignored_keys == ["sequence_parallel", "use_fused_rmsnorm"]


def test_shipped_seed_config_loads():
    cfg = load_run_config("r1_zero_qwen25_7b")
    assert cfg.actor.tensor_model_parallel_size == 4 and cfg.actor.num_layers == 28
    assert cfg.rl.n_samples_per_prompt == 16 and cfg.rl.actor_resource.num_npus == 8
    assert cfg.rl.tensorboard_log_dir == "./work_dir/qwen2.5-math-7b_32_4k/tensorboard_log2"
