"""PPO on 2 Ray CPU workers: the critic is colocated in the actor workers and data parallel (DDP).

On the same experience, the critic's values, the GAE advantages, the value update and the actor
update on 2 workers equal one process (value loss, clip fraction, grad norms, pg loss, KL in the
reward); the 2-worker checkpoint (actor and critic/) resumes in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.cluster.cluster_helpers import column, grpo_config, sample, session_and_trainer

pytestmark = pytest.mark.ray

PPO = {"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "use_kl_in_reward": True, "init_kl_coef": 0.05,
       "epochs": 2, "shuffle_mini_batch": True, "guarantee_order": True, "cliprange_value": 0.5}


def ppo_config(work, name, workers, iters=1, critic=None, rl=None, **train):
    return grpo_config(work, name, workers=workers, iters=iters, rl={**PPO, **(rl or {})},
                       train={"stage": "ray_ppo", **train},
                       sections={"critic_config": critic} if critic else None)


def test_ppo_on_two_workers_equals_one_process_on_the_same_experience(ray_cluster, work):
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.loops.experience import new_dock

    local, local_trainer = session_and_trainer(ppo_config(work, "ppo_local", 1))
    # the critic's values and update on shares balanced by tokens (rl_config.use_dp_batch_balance)
    remote, remote_trainer = session_and_trainer(ppo_config(work, "ppo_ray", 2, rl={"use_dp_batch_balance": True}))
    try:
        assert remote.critic is remote.cluster.critic and remote.cluster.world == 2 and remote.cluster.balance
        td = new_dock(local_trainer.plan.rows_per_update, 8, guarantee_order=True, seed=0)
        sample(local_trainer, td)
        local_trainer.producer.reward(td, MetricAccumulator())
        docks = {"local": td, "ray": copy.deepcopy(td)}
        metrics = {}
        for key, trainer, s in (("local", local_trainer, local), ("ray", remote_trainer, remote)):
            reads, acc = trainer.plan.reads, MetricAccumulator()
            trainer.logprobs(docks[key], "ref_logprobs", s.policy.reference, reads["ref_dispatch_size"], None)
            trainer.logprobs(docks[key], "old_logprobs", s.policy.actor, reads["actor_logprob_dispatch_size"], None)
            trainer.critic.compute_values(docks[key])
            trainer.critic.advantages(docks[key], acc, trainer.kl_ctrl)
            trainer.critic.update(docks[key], acc, 1)
            trainer.update(docks[key], acc, 1)
            metrics[key] = acc.reduce()
        for name in ("values", "advantages", "returns"):
            torch.testing.assert_close(column(docks["ray"], name), column(docks["local"], name), rtol=1e-5, atol=1e-6)
        names = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm",
                 "actor/reward_kl_penalty", "critic/returns/mean")
        for name in names:
            assert metrics["ray"][name] == pytest.approx(metrics["local"][name], rel=1e-4, abs=1e-6), name
        assert metrics["local"]["critic/vf_loss"] > 0 and metrics["local"]["critic/grad_norm"] > 0
        critics = remote.cluster.critic_state_dicts()
        for name, value in local.critic.model.state_dict().items():
            torch.testing.assert_close(critics[0][name], value, rtol=1e-4, atol=1e-5)
            assert torch.equal(critics[1][name], critics[0][name]), name
        # rank 0 saves actor and critic; one process resumes both
        ckpt = work / "ckpt_ppo_ray"
        remote.cluster.save(ckpt, 1, sampler_state=remote.sampler.state_dict(), trainer_state={
            "consumed_samples": 4, "initial_model": str(work / "model")}, save_optim=True, save_rng=True)
        assert (ckpt / "iter_0000001" / "critic" / "config.json").is_file()
        resumed, _ = session_and_trainer(grpo_config(work, "ppo_resumed", workers=1, iters=2, rl=PPO,
                                                     train={"stage": "ray_ppo", "load": str(ckpt)}))
        try:
            assert resumed.iteration == 1
            for name, value in local.critic.model.state_dict().items():
                torch.testing.assert_close(resumed.critic.model.state_dict()[name], value, rtol=1e-4, atol=1e-5)
            want = local.critic.engine.optimizer.state_dict()["state"]
            got = resumed.critic.engine.optimizer.state_dict()["state"]
            assert sorted(got) == sorted(want) and len(want) > 0
        finally:
            resumed.close()
    finally:
        local.close()
        remote.close()


def test_critic_config_save_and_load_are_the_critics_own(ray_cluster, work):
    """critic_config.save: the critic's own checkpoints (written by rank 0 of 2 workers); critic_config.load
    resumes them in one process, finetune keeps the weights only; a foreign save dir is refused."""
    from safetensors.torch import load_file

    from posttrain.errors import ConfigError
    from posttrain.commands.train import train_config as train

    actor_dir, critic_dir = work / "ppo_own_actor", work / "ppo_own_critic"
    train(ppo_config(work, "ppo_own", 2, save=str(actor_dir), save_interval=1,
                     critic={"save": str(critic_dir), "micro_batch_size": 4}))
    saved = critic_dir / "iter_0000001"
    assert (saved / "optimizer.pt").is_file() and not (actor_dir / "iter_0000001" / "critic").exists()
    assert "# PPO critic checkpoint, iteration 1" in (saved / "README.md").read_text()  # its own model card
    weights = load_file(str(saved / "model.safetensors"))
    assert "score.weight" in weights and weights["score.weight"].abs().sum() > 0  # trained from a zero head
    for finetune in (False, True):
        s, _ = session_and_trainer(ppo_config(
            work, f"ppo_own_resume_{finetune}", 1, iters=2, load=str(actor_dir),
            critic={"save": str(work / "ppo_own_critic_ft") if finetune else str(critic_dir), "load": str(critic_dir),
                    "finetune": finetune, "micro_batch_size": 4}))
        try:
            assert s.iteration == 1
            for name, value in s.critic.model.model.state_dict().items():
                assert torch.equal(value, weights[name]), name
            assert bool(s.critic.engine.optimizer.state) == (not finetune)
        finally:
            s.close()
    with pytest.raises(ConfigError, match="critic_config.save .* already holds checkpoints"):
        session_and_trainer(ppo_config(work, "ppo_foreign", 1, save=str(work / "ppo_foreign_actor"),
                                       critic={"save": str(critic_dir)}))
