"""PPO's critic phases for the one on-policy loop (seed 2.4).

The loop (:mod:`posttrain.trainers.onpolicy`) runs, for a bundle with a critic::

    rollout -> reward -> ref logprobs -> old logprobs -> critic values -> advantages (GAE) ->
    critic update -> actor update

:class:`Critic` owns the value model (:class:`~posttrain.models.value_head.ValueHeadModel`: the HF
backbone plus a scalar head), its optimizer and LR schedule, and the three phases it adds:

* ``compute_values``: ``V [B, R]`` at the same shifted positions as the log-probs
  (``timing/critic_model``);
* ``advantages``: token-level rewards (the sequence score at the last response token), minus
  ``beta * KL_penalty(old_logp, ref_logp)`` per token when ``use_kl_in_reward``
  (``beta = kl_ctrl.value``), then GAE with ``gamma``/``lam`` and whitened advantages;
* ``update``: the clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``,
  ``c = cliprange_value``, in mini-batches of ``mini_batch_size x n`` rows for ``epochs`` passes
  (``timing/update_critic``, ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/grad_norm``,
  ``critic/lr``).

The critic starts from ``critic_config.load`` (a reward model / sequence-classification checkpoint,
or a causal-LM directory whose backbone is reused), else from the actor's initial weights; a new
head starts at zero, so the first values are 0. It is saved in the ``critic/`` subdirectory of
every checkpoint and restored from there on resume.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from posttrain.algo.advantages import get_advantage_estimator, scores_to_token_level_rewards
from posttrain.algo.kl import apply_kl_in_reward
from posttrain.config.run import RunConfig
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.trainers.experience import per_token, sequence_batch, unpad

log = logging.getLogger(__name__)


def masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean`` (masked mean), ``/max`` and ``/min`` over the valid tokens (seed 2.4)."""
    valid = x[mask.bool()]
    if valid.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(valid.mean()), f"{prefix}/max": float(valid.max()),
            f"{prefix}/min": float(valid.min())}


def critic_source(cfg: RunConfig) -> tuple[str, bool]:
    """(path of the critic's initial weights, whether it is the actor's)."""
    from posttrain.trainers.setup import model_source

    critic = cfg.critic
    if critic is not None and critic.load and critic.load != cfg.actor.load:
        return critic.load, False
    return model_source(cfg.actor), True


def build_value_model(path: str, device: str):
    """A :class:`ValueHeadModel` from a checkpoint (``iter_*`` or HF dir); a new head starts at 0."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models.value_head import ValueHeadModel

    hf_dir, _ = resolve_checkpoint(path)
    if (Path(hf_dir) / "critic" / "config.json").is_file():  # a posttrain PPO checkpoint
        hf_dir = Path(hf_dir) / "critic"
    model = ValueHeadModel.from_pretrained(hf_dir, dtype="float32", device=device, head_init="zero")
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    return model


class ValueModule(torch.nn.Module):
    """:class:`ValueHeadModel` with the call signature of an HF model (``use_cache`` etc. accepted)."""

    def __init__(self, value_model):
        super().__init__()
        self.value_model = value_model

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        return self.value_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)


class Critic:
    """The PPO critic role: value model + train engine + the loop's critic phases."""

    def __init__(self, cfg: RunConfig, session):
        from posttrain.checkpoint import Part
        from posttrain.trainers.setup import build_train_engine

        self.cfg, self.s = cfg, session
        rl = cfg.rl
        self.n = rl.n_samples_per_prompt
        self.role = cfg.critic or cfg.actor  # megatron_training + critic_config
        path, from_actor = critic_source(cfg)
        self.model = build_value_model(session.initial_model if from_actor else path, session.device)
        gbs = cfg.actor.global_batch_size
        steps = (gbs // rl.mini_batch_size) * rl.epochs * cfg.actor.train_iters
        self.module = ValueModule(self.model)
        self.engine = build_train_engine(self.module, self.role, steps, session.train_dtype, metric_prefix="critic")
        self.estimator = get_advantage_estimator(rl.adv_estimator)
        session.extra_parts["critic"] = Part(self.model.model, self.engine.optimizer, self.engine.scheduler)
        if session.iteration > 0:
            self._resume(Path(session.trainer_state.get("checkpoint_dir", "")))
        log.info("critic: value head on %s (%s)", path, "actor weights" if from_actor else "critic_config.load")

    def _resume(self, ckpt: Path) -> None:
        from posttrain.checkpoint import load_weights

        part = ckpt / "critic"
        if not (part / "config.json").is_file():
            log.warning("resumed checkpoint %s has no critic/: the critic starts afresh", ckpt)
            return
        load_weights(part, self.model.model)
        if not self.cfg.actor.no_load_optim and (part / "optimizer.pt").is_file():
            self.engine.optimizer.load_state_dict(torch.load(part / "optimizer.pt", weights_only=False))
            if (part / "scheduler.pt").is_file():
                self.engine.scheduler.load_state_dict(torch.load(part / "scheduler.pt", weights_only=False))

    # ---- phases ------------------------------------------------------------------------------
    def compute_values(self, td) -> None:
        """``values`` column: V at every response token (no gradient)."""
        rl = self.cfg.rl
        while not td.all_consumed("critic_compute_values"):
            batch, idx = td.get("critic_compute_values", ["prompts", "responses", "response_length"],
                                rl.critic_value_dispatch_size)
            tensors = sequence_batch(batch["prompts"], batch["responses"], self.s.pad_token_id)
            values = self.engine.compute_values(tensors, micro_batch_size=self.role.micro_batch_size)
            td.put(["values"], idx, [unpad(values.float(), [int(x) for x in batch["response_length"]])])

    def advantages(self, td, acc: MetricAccumulator, kl_ctrl) -> None:
        """Token rewards (+ KL in reward), GAE, ``advantages``/``returns`` columns, critic/* stats."""
        rl = self.cfg.rl
        columns = ["rm_scores", "response_length", "values"]
        if rl.use_kl_in_reward:
            columns += ["old_log_prob", "ref_log_prob"]
        while not td.all_consumed("compute_advantage"):
            batch, idx = td.get("compute_advantage", columns, rl.adv_dispatch_size, get_n_samples=True)
            lengths = [int(x) for x in batch["response_length"]]
            width = max(max(lengths), 1)
            mask = per_token([torch.ones(n) for n in lengths], width)
            scores = torch.cat([r.reshape(-1) for r in batch["rm_scores"]])
            rewards = scores_to_token_level_rewards(scores, mask)
            if rl.use_kl_in_reward:
                rewards, kl_metrics = apply_kl_in_reward(
                    rewards, per_token(batch["old_log_prob"], width), per_token(batch["ref_log_prob"], width), mask,
                    kl_coef=kl_ctrl.value, kl_penalty=rl.kl_penalty)
                acc.update(kl_metrics)
            values = per_token(batch["values"], width)
            adv, returns = self.estimator(rewards, mask, values=values, group_size=self.n, gamma=rl.gamma,
                                          lam=rl.lam, whiten=True)
            td.put(["advantages", "returns"], idx, [unpad(adv, lengths), unpad(returns, lengths)])
            acc.update({**masked_stats("critic/advantages", adv, mask), **masked_stats("critic/returns", returns, mask),
                        **masked_stats("critic/values", values, mask)})

    def update(self, td, acc: MetricAccumulator, iteration: int) -> None:
        """Clipped value-loss steps on ``returns`` with the old ``values``."""
        from posttrain.train.loss_fns import make_critic_loss_fn

        rl = self.cfg.rl
        loss_fn = make_critic_loss_fn(cliprange_value=rl.cliprange_value)
        while not td.all_consumed("critic_train"):
            batch, _ = td.get("critic_train", ["prompts", "responses", "values", "returns"],
                              rl.critic_update_dispatch_size)
            tensors = sequence_batch(batch["prompts"], batch["responses"], self.s.pad_token_id)
            width = tensors["response_mask"].shape[1]
            tensors["values"] = per_token(batch["values"], width)
            tensors["returns"] = per_token(batch["returns"], width)
            steps = self.engine.update(tensors, loss_fn, mini_batch_size=rl.mini_batch_size * self.n,
                                       epochs=rl.epochs, shuffle=rl.shuffle_mini_batch,
                                       seed=self.cfg.actor.seed + iteration)
            for step in steps:
                acc.update(step)
