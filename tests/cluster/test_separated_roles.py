"""The seed's separated roles (``use_integrated_worker: false`` with ``reference_resource``,
``reward_resource`` and ``critic_resource``): PPO's frozen reference, the reward model and the
critic in Ray worker groups of their own, beside one actor worker. The run equals the integrated
one in this process (every role colocated with the actor): the same responses, every metric but
the wall-clock ones within 1e-5 (the critic's values, value loss and gradient norm included).
``blocking: false`` (the reference's and the actor's log-probs and the critic's values started
together) gives the same second iteration again after resuming the integrated run's first
checkpoints (the actor's, and the critic's own): the reference group is built from the run's
initial model, not from the resumed weights, and the critic group resumes its weights and optimizer.
Partial rollout and ``async_staleness`` with the reference (and, async, the reward model) in groups
of their own equal the integrated run too: responses, metrics and final weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import PPO, checkpoint_weights, is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY_CPUS = 4  # one actor worker, and one worker each for the reference, the reward model and the critic

SEPARATED = {"use_integrated_worker": False, "reference_resource": {"num_npus": 1},
             "reward_resource": {"num_npus": 1}, "critic_resource": {"num_npus": 1}}


def config(work, rm_dir, name: str, rl: dict | None = None, train: dict | None = None, critic: dict | None = None):
    """2 PPO iterations: the KL in the reward (a reference), rule + reward-model scores, a critic
    saving checkpoints of its own."""
    return grpo_config(work, name, workers=1, iters=2,
                       rl={"init_kl_coef": 0.05, "reward_model_weight": 0.5, **PPO, **(rl or {})},
                       train={"stage": "ray_ppo", **(train or {})},
                       sections={"reward_config": {"load": str(rm_dir), "micro_batch_size": 4},
                                 "critic_config": {"save": str(work / f"critic_{name}"), **(critic or {})}})


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        compared = [k for k in w if not is_wall_clock(k)]
        for key in compared:
            assert same(g[key], w[key], key), (w["iteration"], key, g[key], w[key])
        assert len(compared) > 15


def trained_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


def test_separated_roles_equal_the_integrated_run_blocking_or_not(ray_cluster, work, lowercase_rm_dir):
    sessions: list = []
    ckpt = work / "ckpt_sep_integrated"
    base = record_run(config(work, lowercase_rm_dir, "sep_integrated", train={"save": str(ckpt), "save_interval": 1}))
    separated = record_run(config(work, lowercase_rm_dir, "sep_blocking", rl=SEPARATED), sessions)
    cluster = sessions[0].cluster
    assert list(cluster.groups) == ["reference", "reward", "critic"]  # the roles' own groups, beside the actor
    pgs = [cluster.pg.id, *(g.pg.id for g in cluster.groups.values())]
    assert len(set(pgs)) == 4 and [len(g.names) for g in cluster.groups.values()] == [1, 1, 1]
    (base_batches, base_rows, _), (sep_batches, sep_rows, _) = base, separated
    assert sep_batches == base_batches and base_batches[0] != base_batches[1]
    base_rows, sep_rows = trained_rows(base_rows), trained_rows(sep_rows)
    assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 for r in base_rows)  # the critic trained
    assert base_rows[-1]["actor/reward_kl_penalty"] != 0  # the reference's log-probs are in the reward
    assert base_rows[0]["reward_model/score/max"] > base_rows[0]["reward_model/score/min"]
    assert_same_rows(sep_rows, base_rows)
    # blocking: false, resumed from the integrated run's first iteration: its second iteration again
    overlapped = record_run(config(work, lowercase_rm_dir, "sep_overlap", rl={**SEPARATED, "blocking": False},
                                   train={"load": str(ckpt / "iter_0000001")},
                                   critic={"load": str(work / "critic_sep_integrated" / "iter_0000001")}))
    over_batches, over_rows, _ = overlapped
    assert over_batches == base_batches[1:]
    over_rows = trained_rows(over_rows)
    assert_same_rows(over_rows, base_rows[1:])
    # the three passes were awaited together (one span), where the blocking run timed each on its own
    assert over_rows[0]["timing/reference_model"] == over_rows[0]["timing/old_log_p"] == over_rows[0][
        "timing/critic_model"]
    assert sep_rows[1]["timing/reference_model"] != sep_rows[1]["timing/old_log_p"]





# GRPO with the KL loss, the reference in a group of its own; partial rollout: rounds of half the new
# tokens; async: also the reward model in a group of its own (called from the rollout thread while
# the trainer's thread calls the reference) and the passes started together (blocking: false)
OFF_POLICY = {"partial": ({"partial_rollout_max_split": 2}, {}),
              "async": ({"async_staleness": 1, "reward_model_weight": 0.5},
                        {"reward_resource": {"num_npus": 1}, "blocking": False})}


def off_policy_config(work, rm_dir, mode: str, name: str, separated: bool):
    off_policy, groups = OFF_POLICY[mode]
    rl = {"init_kl_coef": 0.05, **off_policy,
          **({"use_integrated_worker": False, "reference_resource": {"num_npus": 1}, **groups} if separated else {})}
    reward_model = {"reward_config": {"load": str(rm_dir), "micro_batch_size": 4}} if "reward_model_weight" in rl else {}
    return grpo_config(work, name, workers=1, iters=2, rl=rl, train={"save": str(work / f"ckpt_{name}")},
                       sections=reward_model)


@pytest.mark.parametrize("mode", list(OFF_POLICY))
def test_partial_or_async_rollout_with_separated_roles_equals_the_integrated_run(ray_cluster, work, lowercase_rm_dir,
                                                                                  mode):
    """Partial rollout (groups wait in the dock and finish in a later iteration) or ``async_staleness:
    1`` (iteration 2 samples with version 0 while version 1 trains): the reference's log-probs (and
    the reward model's scores) come from the roles' own groups for whichever samples the rollout
    finished, whatever round or version they came from. The same responses, metrics and final
    weights as the integrated run in this process."""
    runs, sessions = {}, []
    for name in ("integrated", "separated"):
        cfg = off_policy_config(work, lowercase_rm_dir, mode, f"{mode}_{name}", separated=name == "separated")
        runs[name] = record_run(cfg, sessions)
    groups = ["reference", "reward"] if mode == "async" else ["reference"]
    assert sessions[0].cluster is None and list(sessions[1].cluster.groups) == groups
    (base_batches, base_rows, _), (sep_batches, sep_rows, _) = runs["integrated"], runs["separated"]
    assert sep_batches == base_batches and base_batches[0] != base_batches[1]
    base_rows, sep_rows = trained_rows(base_rows), trained_rows(sep_rows)
    if mode == "partial":
        assert max(r["rollout/age_max"] for r in base_rows) >= 1  # groups finished in a later iteration
    else:
        assert base_rows[-1]["rollout/staleness_max"] >= 1  # iteration 2 sampled with version 0
        assert base_rows[0]["reward_model/score/max"] > base_rows[0]["reward_model/score/min"]
    assert all(r["actor/kl_loss"] > 0 for r in base_rows[1:])  # the reference's log-probs are in the loss
    assert_same_rows(sep_rows, base_rows)
    weights = {name: checkpoint_weights(work / f"ckpt_{mode}_{name}" / "iter_0000002") for name in runs}
    initial = checkpoint_weights(work / "model")
    assert any(not torch.equal(weights["integrated"][k], initial[k]) for k in initial)  # the actor learned
    for key, want in weights["integrated"].items():
        torch.testing.assert_close(weights["separated"][key], want, rtol=1e-5, atol=1e-6, msg=key)
