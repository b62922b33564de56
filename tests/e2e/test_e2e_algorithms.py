"""PPO, DAPO and DPO end to end on a mini random-init Qwen2 (2 layers, hidden 64), on CPU.

* PPO (critic from the actor, GAE, clipped value loss) raises a graded reward: the fraction of
  lowercase letters in the response (verifier ``e2e_lowercase``, tests/helpers/verifiers.py).
* DAPO with dynamic sampling (binary ``e2e_has_lowercase`` reward, clip-higher) runs, reports
  ``train/num_gen_batches``, and raises the seed's error when no group ever varies.
* DPO on synthetic pairs ("Repeat the letter w" -> chosen ``w``, rejected another letter) reaches
  ``rewards/accuracies`` > 0.9 with a growing margin; the other loss types run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.data import letter_pair, preprocess_prompts, random_addition, write_jsonl
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # 2 threads thrash on a loaded 2-core box


@pytest.fixture(scope="module")
def work(tmp_path_factory, mini_qwen2_dir):
    """A 2-layer Qwen2 with the tiny tokenizer, a prompt dataset and a pairwise dataset."""
    import shutil

    from posttrain.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("algos")
    shutil.copytree(mini_qwen2_dir, root / "model")
    rng = random.Random(0)
    prompts, pairs = [], []
    for _ in range(256):
        prompts.append(random_addition(rng))
        pairs.append(letter_pair(rng))
    preprocess_prompts(prompts, root / "prompts.jsonl", root / "model", root / "prompts/data", prompt_type="trl",
                       workers=1)
    write_jsonl(root / "pairs.jsonl", pairs)
    preprocess(dict(input=str(root / "pairs.jsonl"), handler_name="AlpacaStylePairwiseHandler",
                    output_prefix=str(root / "pairs/data"),
                    map_keys={"prompt": "problem", "chosen": "chosen", "rejected": "rejected"},
                    tokenizer_name_or_path=str(root / "model"), prompt_type="trl", workers=1), progress=False)
    return root


def onpolicy_config(work: Path, stage: str, iters: int, rl: dict, name: str, save: bool = False):
    train = {"stage": stage, "micro_batch_size": 32}
    if save:
        train["save"] = str(work / f"ckpt_{name}")
    return run_config(work / "model", work / "prompts/data", work / f"run_{name}", name=name, iters=iters,
                      megatron_training=train, rl_config={"mini_batch_size": 4, **rl})


def test_ppo_raises_reward_and_saves_the_critic(work):
    from transformers import AutoModelForSequenceClassification

    from posttrain.commands.train import train_config as train

    cfg = onpolicy_config(work, "ray_ppo", 12, {"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "epochs": 2,
                                                "cliprange_value": 0.5}, "ppo", save=True)
    last = train(cfg)
    rows = [r for r in read_metrics(work / "run_ppo") if "critic/score/mean" in r]
    scores = [r["critic/score/mean"] for r in rows]
    assert len(scores) == 12
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.15, scores
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "critic/values/mean",
                "critic/returns/max", "critic/advantages/min", "critic/score/max", "timing/critic_model",
                "timing/update_critic", "actor/pg_loss"):
        assert key in last, key
    assert "actor/kl_loss" not in last  # PPO has no KL term in the loss
    critic_dir = work / "ckpt_ppo" / "iter_0000012" / "critic"
    assert (critic_dir / "optimizer.pt").is_file()
    saved = AutoModelForSequenceClassification.from_pretrained(critic_dir)  # an HF-loadable value model
    # a resumed run restores the critic (weights and optimizer) from the checkpoint's critic/
    import torch

    from posttrain.config.plan import resolve_plan
    from posttrain.roles.critic import Critic

    state = {"iteration": 12, "initial_model": str(work / "model"), "checkpoint_dir": str(critic_dir.parent)}
    critic = Critic(resolve_plan(cfg, device="cpu"), state, "cpu")
    for name, value in saved.state_dict().items():
        assert torch.equal(critic.model.model.state_dict()[name], value), name
    assert critic.engine.optimizer.state_dict()["state"]  # Adam moments restored
    assert critic.part.model is critic.model.model


def test_ppo_kl_in_reward_uses_the_reference_only_in_the_reward(work):
    from posttrain.commands.train import train_config as train

    rl = {"adv_estimator": "gae", "use_kl_in_reward": True, "init_kl_coef": 0.05, "kl_penalty": "low_var_kl"}
    last = train(onpolicy_config(work, "ray_ppo", 2, rl, "ppo_kl"))
    assert "timing/reference_model" in last and "timing/old_log_p" in last
    assert last["actor/reward_kl_penalty"] > 0 and last["actor/reward_kl_penalty_coeff"] == 0.05
    assert "actor/kl_loss" not in last  # no KL term in the PPO actor loss


def test_dapo_dynamic_sampling_reports_num_gen_batches(work):
    from posttrain.commands.train import train_config as train

    rl = {"verifier_function": ["e2e_has_lowercase"], "filter_groups_enable": True,
          "filter_groups_metric": "e2e_has_lowercase", "filter_groups_train_batch_size": 4,
          "filter_groups_max_batches": 0, "clip_higher_enable": True, "clip_ratio_low": 0.2,
          "clip_ratio_high": 0.28, "token_level_loss": True}
    last = train(onpolicy_config(work, "ray_dapo", 2, rl, "dapo"))
    assert last["train/num_gen_batches"] >= 1
    assert {"dapo/score/mean", "dapo/score/max", "dapo/score/min", "e2e_has_lowercase_rewards/mean"} <= set(last)
    assert "actor/kl_loss" not in last and "timing/reference_model" not in last  # no reference model
    assert 0.0 < last["dapo/score/mean"] < 1.0  # kept groups always have both outcomes


def test_dapo_dynamic_sampling_cap_raises_the_seed_error(work):
    from posttrain.errors import DataError
    from posttrain.commands.train import train_config as train

    rl = {"verifier_function": ["e2e_constant"], "filter_groups_enable": True, "filter_groups_metric": "e2e_constant",
          "filter_groups_train_batch_size": 4, "filter_groups_max_batches": 2}
    with pytest.raises(DataError, match="^Generated too many. Please check your data."):
        train(onpolicy_config(work, "ray_dapo", 1, rl, "dapo_cap"))


def dpo_config(work: Path, iters: int, name: str, **keys):
    return run_config(work / "model", work / "pairs/data", work / f"run_{name}", name=name, stage="dpo", iters=iters,
                      megatron_training={"global_batch_size": 32, "micro_batch_size": 16, "lr": 1e-2,
                                         "dataset_additional_keys": OMIT, "prompt_type": OMIT,
                                         "is_pairwise_dataset": True, "dpo_beta": 0.5, **keys})


def test_dpo_raises_accuracy_and_margin(work):
    from posttrain.commands.train import train_config as train

    train(dpo_config(work, 25, "dpo"))
    rows = read_metrics(work / "run_dpo")
    assert rows[0]["dpo/loss"] == pytest.approx(0.693147, abs=1e-4)  # policy == reference: log 2
    acc = [r["rewards/accuracies"] for r in rows]
    margins = [r["rewards/margins"] for r in rows]
    assert sum(acc[-5:]) / 5 > 0.9, acc
    assert sum(margins[-5:]) / 5 > 1.0 > abs(margins[0]), margins
    assert rows[-1]["rewards/chosen"] > rows[-1]["rewards/rejected"]


def test_orpo_trains_without_a_reference(work):
    from posttrain.commands.train import train_config as train

    train(dpo_config(work, 8, "orpo", dpo_loss_type="orpo", dpo_beta=1.0))
    rows = read_metrics(work / "run_orpo")
    assert "timing/reference_model" not in rows[-1] and "timing/data" in rows[-1]  # no reference model ran
    # rewards are beta x the policy's mean token log-probs here: the chosen answers' rise above the rejected ones'
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"] + 0.5, [r["rewards/margins"] for r in rows]
    assert rows[-1]["dpo/loss"] < rows[0]["dpo/loss"]


# the loss at the reference (z = 0, beta = 0.5): hinge relu(1) = 1, ipo (0 - 1/(2 beta))^2 = 1,
# kto_pair (1 - sigma(0)) = 0.5, smoothed sigmoid log 2 plus pref_ftx x the chosen NLL (> 0)
@pytest.mark.parametrize("keys,first_loss", [
    ({"dpo_loss_type": "hinge"}, 1.0), ({"dpo_loss_type": "ipo"}, 1.0), ({"dpo_loss_type": "kto_pair"}, 0.5),
    ({"dpo_loss_type": "sigmoid", "dpo_label_smoothing": 0.1, "pref_ftx": 0.5}, None)])
def test_dpo_loss_types_train(work, keys, first_loss):
    import math

    from posttrain.commands.train import train_config as train

    name = "dpo_" + "_".join(str(v) for v in keys.values())
    train(dpo_config(work, 3, name, **keys))
    rows = read_metrics(work / f"run_{name}")
    assert len(rows) == 3 and all(math.isfinite(r["dpo/loss"]) for r in rows)
    if first_loss is None:
        assert rows[0]["dpo/loss"] > math.log(2) + 0.1  # the SFT term adds the chosen answer's NLL
    else:
        assert rows[0]["dpo/loss"] == pytest.approx(first_loss, abs=1e-4)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)


def test_dpo_reference_is_ref_model_at_refer_model_iter(work):
    """``refer_model_iter`` picks the iteration of ``ref_model``'s checkpoint directory: with the
    policy started from iteration 1's weights, the reference at iteration 1 is the policy itself (the
    first loss is log 2, margin 0), at iteration 2 it is not; an iteration not there is refused."""
    import math

    from posttrain.commands.train import train_config as train
    from posttrain.errors import ConfigError

    small = {"global_batch_size": 8, "micro_batch_size": 8}
    ckpt = work / "ckpt_dpo_ref"
    train(dpo_config(work, 2, "dpo_ref_base", **small, save=str(ckpt), save_interval=1))
    start = {**small, "ref_model": str(ckpt), "load": str(ckpt / "iter_0000001"), "finetune": True}
    for iteration in (1, 2):
        train(dpo_config(work, 1, f"dpo_ref_{iteration}", **start, refer_model_iter=iteration))
    same, later = (read_metrics(work / f"run_dpo_ref_{i}")[0] for i in (1, 2))
    assert same["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5) and same["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert abs(later["rewards/margins"]) > 1e-3 and abs(later["dpo/loss"] - math.log(2)) > 1e-4
    with pytest.raises(ConfigError, match=r"refer_model_iter=3: ref_model=.* holds no iter_0000003 \(it holds "
                                          r"iter_0000001, iter_0000002\)"):
        train(dpo_config(work, 1, "dpo_ref_3", **start, refer_model_iter=3))
