"""The reward model of reward_config on 2 Ray CPU workers: loaded by every actor worker (colocated),
scoring contiguous row shares. With keyed sampling the rollouts of 2 workers are those of one
process, so the combined scores (rule + weight x reward model) and the reward_model/score/* metrics
are the same too.
"""

from __future__ import annotations

import pytest
import torch

from tests.cluster.cluster_helpers import column, grpo_config, sample, session_and_trainer

pytestmark = pytest.mark.ray


def rm_config(work, rm_dir, name, workers):
    # on 2 workers the reward model's shares are balanced by tokens (rl_config.use_dp_batch_balance)
    rl = {"reward_model_weight": 0.5, "guarantee_order": True, "use_dp_batch_balance": workers > 1}
    return grpo_config(work, name, workers=workers, iters=1, rl=rl,
                       sections={"reward_config": {"load": str(rm_dir), "micro_batch_size": 4}})


def test_two_workers_score_like_one_process(ray_cluster, work, lowercase_rm_dir):
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.metrics.timers import Timers
    from posttrain.loops.experience import new_dock

    local, local_trainer = session_and_trainer(rm_config(work, lowercase_rm_dir, "rm_local", 1))
    remote, remote_trainer = session_and_trainer(rm_config(work, lowercase_rm_dir, "rm_ray", 2))
    try:
        assert remote.reward_model is remote.cluster.reward_model and remote.cluster.world == 2
        docks, metrics = {}, {}
        for key, trainer in (("local", local_trainer), ("ray", remote_trainer)):
            td = new_dock(trainer.plan.rows_per_update, 8, guarantee_order=True, seed=0)
            sample(trainer, td)
            acc, timers = MetricAccumulator(), Timers()
            trainer.producer.reward(td, acc, timers)
            docks[key], metrics[key] = td, {**acc.reduce(), **timers.metrics()}
        assert torch.equal(column(docks["ray"], "responses"), column(docks["local"], "responses"))
        torch.testing.assert_close(column(docks["ray"], "scores"), column(docks["local"], "scores"), rtol=1e-6,
                                   atol=1e-6)
        for name in ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min",
                     "e2e_lowercase_rewards/mean"):
            assert metrics["ray"][name] == pytest.approx(metrics["local"][name], rel=1e-6), name
        assert metrics["local"]["reward_model/score/max"] > metrics["local"]["reward_model/score/min"]
        assert {"timing/reward_model", "timing/rule_reward"} <= set(metrics["ray"])
    finally:
        local.close()
        remote.close()
