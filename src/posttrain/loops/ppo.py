"""PPO's critic phases for the one on-policy loop (seed 2.4).

The loop (:mod:`posttrain.loops.onpolicy`) runs, for a bundle with a critic::

    rollout -> reward -> ref logprobs -> old logprobs -> critic values -> advantages (GAE) ->
    critic update -> actor update

:class:`CriticPhases` drives the critic role (:class:`posttrain.roles.critic.Critic`: the value
model, its optimizer and LR schedule) through the three phases PPO adds:

* ``compute_values``: ``V [B, R]`` at the same shifted positions as the log-probs
  (``timing/critic_model``);
* ``advantages``: token-level rewards (the sequence score at the last response token), minus
  ``beta * KL_penalty(old_logp, ref_logp)`` per token when ``use_kl_in_reward``
  (``beta = kl_ctrl.value``), then GAE with ``gamma``/``lam`` and whitened advantages;
* ``update``: the clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``,
  ``c = cliprange_value``, in mini-batches of ``mini_batch_size x n`` rows for ``epochs`` passes
  (``timing/update_critic``, ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/grad_norm``,
  ``critic/lr``).

Where the critic's weights come from and how it is checkpointed: :mod:`posttrain.roles.critic`.
"""

from __future__ import annotations

import logging

import torch

from posttrain.algo.advantages import compute_advantages, scores_to_token_level_rewards
from posttrain.algo.kl import apply_kl_in_reward
from posttrain.config.plan import Plan
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import stat_metrics
from posttrain.metrics.timers import Timers
from posttrain.loops.experience import per_group, read_batch, write_rows
from posttrain.training.batch import per_token
from posttrain.training.loss_fns import make_critic_loss_fn

log = logging.getLogger(__name__)


class CriticPhases:
    """The loop's critic phases, on a :class:`~posttrain.roles.critic.Critic` built for the session."""

    def __init__(self, plan: Plan, session):
        self.plan, self.s = plan, session
        self.critic = session.critic  # in process, or the Ray workers' (same methods)

    def compute_values(self, td) -> None:
        """``values`` column: V at every response token (no gradient)."""
        while not td.all_consumed("critic_values"):
            batch, idx, lengths = read_batch(td, "critic_values", [], self.plan.reads["critic_value_dispatch_size"],
                                             pad_token_id=self.s.policy.pad_token_id)
            values = self.critic.compute_values(batch)
            write_rows(td, ["values"], idx, [values], lengths)

    def advantages(self, td, acc: MetricAccumulator, kl_ctrl, timers: Timers | None = None) -> None:
        """Token rewards (+ KL in reward, timed as ``timing/kl`` within ``timing/adv``), GAE,
        ``advantages``/``returns`` columns, critic/* stats."""
        timers = timers if timers is not None else Timers()
        kl, adv = self.plan.kl, self.plan.advantages
        columns = ["scores", "response_length", "values"]
        if kl.in_reward:
            columns += ["old_logprobs", "ref_logprobs"]
        while not td.all_consumed("advantages"):
            batch, idx = td.get("advantages", columns, self.plan.reads["adv_dispatch_size"], get_n_samples=True)
            lengths, mask = per_group(batch)
            width = mask.shape[1]
            scores = torch.cat([r.reshape(-1) for r in batch["scores"]])
            rewards = scores_to_token_level_rewards(scores, mask)
            if kl.in_reward:
                with timers("kl"):
                    rewards, kl_metrics = apply_kl_in_reward(
                        rewards, per_token(batch["old_logprobs"], width), per_token(batch["ref_logprobs"], width),
                        mask, kl_coef=kl_ctrl.value, kl_penalty=kl.penalty)
                acc.update(kl_metrics)
            values = per_token(batch["values"], width)
            advantages, returns = compute_advantages(adv.estimator, rewards, mask, values=values, group_size=self.plan.n,
                                                     gamma=adv.gamma, lam=adv.lam, whiten=True)
            write_rows(td, ["advantages", "returns"], idx, [advantages, returns], lengths)
            acc.update({**stat_metrics("critic/advantages", advantages, mask),
                        **stat_metrics("critic/returns", returns, mask),
                        **stat_metrics("critic/values", values, mask)})

    def update(self, td, acc: MetricAccumulator, iteration: int) -> None:
        """Clipped value-loss steps on ``returns`` with the old ``values``."""
        u = self.plan.update
        loss_fn = self.s.dumps.watch_loss(make_critic_loss_fn(cliprange_value=self.plan.critic.cliprange_value))
        while not td.all_consumed("critic_update"):
            batch, _, _ = read_batch(td, "critic_update", ["values", "returns"],
                                     self.plan.reads["critic_update_dispatch_size"],
                                     pad_token_id=self.s.policy.pad_token_id)
            steps = self.critic.update(batch, loss_fn, mini_batch_size=self.plan.mini_batch_rows,
                                       epochs=u.epochs, shuffle=u.shuffle, seed=u.seed + iteration)
            for step in steps:
                acc.update(step)
