"""``posttrain plan`` refuses what ``posttrain train`` refuses at start-up about the files a config
names (posttrain.config.files): each case runs through both commands, which must stop with the same
message. The cases of the reliability probes (docs/reliability/probe3_cmds.md); each id is in the
parametrize ids and in the docstring of the test."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.runs import run_cli, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _adapter(world, tmp_path, r: int = 8):
    """A copy of the mini model holding a LoRA adapter's config (r 8, alpha 16, q_proj and v_proj)."""
    path = tmp_path / "lora_ckpt"
    shutil.copytree(world / "model", path)
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                                          "base_model_name_or_path": str(world / "model")}))
    return path


def _old_run(tmp_path):
    save = tmp_path / "old" / "ckpt"
    (save / "iter_0000001").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "old" / "out").mkdir()
    (tmp_path / "old" / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    return tmp_path / "old"


LORA = ["megatron_training.lora_r=8", "megatron_training.lora_alpha=16"]
CASES = {  # id: (overrides given the world and tmp_path, what the message says)
    "L3p": (lambda w, t: [*LORA, "megatron_training.lora_target_modules=[nosuch]"],
            "actor_config.lora_target_modules: 'nosuch' matches no linear layer of the model"),
    "CM43": (lambda w, t: [*LORA, "megatron_training.lora_target_modules=[mlp]"], "'mlp' matches no linear layer"),
    "PV1": (lambda w, t: [f"actor_config.save={w / 'model' / 'config.json'}"],
            "actor_config.save {w}/model/config.json is an existing file, not a directory"),
    "PV3": (lambda w, t: ["megatron_training.prompt_type=nosuch"], "prompt_type 'nosuch' is not a known template"),
    "PV4": (lambda w, t: [f"rl_config.eval_data_path={t / 'nosuch'}"], "rl_config.eval_data_path {t}/nosuch: no files"),
    "PV5": (lambda w, t: [f"actor_config.load={w / 'model' / 'config.json'}"],
            "load: {w}/model/config.json is not a directory"),
    "PV6": (lambda w, t: ["actor_config.load=null", f"megatron_training.tokenizer_name_or_path={t}"],
            "load: no checkpoint in {t}"),
    "CM51": (lambda w, t: [f"megatron_training.data_path={t / 'nosuch'}"], "data_path {t}/nosuch: no files"),
    "CM52": (lambda w, t: [f"rl_config.output_dir={w / 'model' / 'config.json' / 'out'}"],
             "rl_config.output_dir {w}/model/config.json/out: cannot create the directory"),
    "CM46": (lambda w, t: [*LORA[1:], "megatron_training.lora_r=16", "megatron_training.lora_target_modules=[q_proj,v_proj]",
                           f"actor_config.load={_adapter(w, t)}"],
             "actor_config.lora_r: the run asks for 16 but the adapter in {t}/lora_ckpt has 8"),
    "CM47": (lambda w, t: [f"actor_config.load={_adapter(w, t)}"], "{t}/lora_ckpt holds a LoRA adapter: set "
                                                                  "actor_config.lora_target_modules"),
    "CM48": (lambda w, t: [f"actor_config.save={_old_run(t) / 'ckpt'}"],
             "actor_config.save {t}/old/ckpt already holds checkpoints"),
    "CM49": (lambda w, t: [f"rl_config.output_dir={_old_run(t) / 'out'}"],
             "rl_config.output_dir {t}/old/out already holds the metrics of an earlier run"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_plan_refuses_what_train_refuses_at_start_up(mini_world, tmp_path, capsys, case):
    """Probes L3p, PV1, PV3, PV4, PV5, PV6, CM43, CM46-CM49, CM51, CM52: plan called these configs
    valid while train refused them at start-up; now both stop with the same message."""
    overrides, expected = CASES[case]
    args = write_config(mini_world, tmp_path / "run")
    given = overrides(mini_world, tmp_path)
    expected = expected.format(w=mini_world, t=tmp_path)
    code, plan_err = run_cli(["plan", *args, *given], capsys)
    assert code == 2 and expected in plan_err, plan_err
    code, train_err = run_cli(["train", *args, *given], capsys)
    assert code == 2 and plan_err.startswith(train_err.rstrip("\n"))  # plan adds how to skip the file checks
    assert "--config-only checks the config alone" in plan_err
    assert not (tmp_path / "run" / "out" / "metrics.jsonl").exists()


def test_plan_config_only_leaves_the_files_out(mini_world, tmp_path, capsys):
    """Probe PV4 (the way out for a config whose data is not there yet): --config-only checks the
    config alone, and says so."""
    from posttrain.cli import main

    args = write_config(mini_world, tmp_path / "run")
    assert main(["plan", "--config-only", *args, f"rl_config.eval_data_path={tmp_path / 'nosuch'}"]) == 0
    assert "--config-only: the datasets, model and directories it names were not checked" in capsys.readouterr().out
