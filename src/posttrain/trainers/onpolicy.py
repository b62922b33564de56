"""The on-policy loop (GRPO, DAPO, PPO): one iteration reads like the algorithm.

    put prompts (x n) -> rollout -> reward -> advantages -> reference logprobs -> old logprobs -> update

Every stage reads its inputs from the TransferDock and writes its outputs back, in the dispatch
sizes of the plan. What differs between algorithms lives in :mod:`posttrain.trainers.bundles`.
"""

from __future__ import annotations

import logging
import math

import torch

from posttrain.algo.advantages import get_advantage_estimator, scores_to_token_level_rewards
from posttrain.algo.kl import build_kl_controller
from posttrain.config.run import RunConfig
from posttrain.config.validate import Layout
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import compute_tps, prompt_length_metrics, response_length_metrics, score_metrics
from posttrain.metrics.timers import Timers
from posttrain.trainers.bundles import Bundle
from posttrain.trainers.dynamic_sampling import score_columns
from posttrain.trainers.experience import per_token, sequence_batch, unpad
from posttrain.trainers.session import Session
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)

COLUMNS = ("prompts", "prompt_length", "labels", "responses", "response_length", "rm_scores",
           "old_log_prob", "ref_log_prob", "advantages", "returns", "values")
CONSUMERS = ("actor_rollout", "rule_reward", "compute_advantage", "ref_log_prob", "actor_log_prob",
             "actor_train", "critic_compute_values", "critic_train")


class OnPolicyTrainer:
    def __init__(self, cfg: RunConfig, layout: Layout, bundle: Bundle, session: Session):
        self.cfg, self.layout, self.bundle, self.s = cfg, layout, bundle, session
        rl = cfg.rl
        self.n = rl.n_samples_per_prompt
        self.gbs = cfg.actor.global_batch_size
        self.estimator = get_advantage_estimator(rl.adv_estimator)
        self.kl_ctrl = build_kl_controller(rl.kl_ctrl_type, init_kl_coef=rl.init_kl_coef, kl_target=rl.kl_target,
                                           kl_horizon=rl.kl_horizon)
        if "kl_ctrl" in session.trainer_state:
            self.kl_ctrl.load_state_dict(session.trainer_state["kl_ctrl"])
        # The seed skips the old-logprob pass when the update is purely on-policy (ratio == 1).
        self.skip_old_logprobs = rl.mini_batch_size == self.gbs and rl.epochs == 1 and not rl.use_kl_in_reward
        # PPO: the critic role (values, GAE, value-loss update); DAPO: dynamic sampling
        from posttrain.trainers.dynamic_sampling import DynamicSampler
        from posttrain.trainers.ppo import Critic

        self.critic = Critic(cfg, session) if bundle.uses_critic else None
        self.dynamic = (DynamicSampler(rl, self.gbs, cfg.actor.seed)
                        if bundle.name == "dapo" and rl.filter_groups_enable else None)
        self.train_rows = self.dynamic.train_rows if self.dynamic is not None else self.gbs * self.n
        if self.dynamic is not None:  # dynamic sampling updates on filter_groups_train_batch_size prompts
            self.skip_old_logprobs = rl.mini_batch_size == self.dynamic.train_prompts and rl.epochs == 1

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        s, train_iters = self.s, self.cfg.actor.train_iters
        last: dict[str, float] = {}
        for iteration in range(s.iteration + 1, train_iters + 1):
            last = self.train_step(iteration)
            s.iteration = iteration
            s.logger.log(iteration, last)
            s.after_iteration(iteration, {"kl_ctrl": self.kl_ctrl.state_dict()})
        s.finish({"kl_ctrl": self.kl_ctrl.state_dict()})
        return last

    def train_step(self, iteration: int) -> dict[str, float]:
        rl, s = self.cfg.rl, self.s
        timers, acc = Timers(), MetricAccumulator()
        td = TransferDock(self.train_rows, COLUMNS, CONSUMERS, n_samples_per_prompt=self.n,
                          guarantee_order=rl.guarantee_order, seed=self.cfg.actor.seed + iteration)
        with timers("all"):
            if self.dynamic is not None:  # DAPO: generate and filter until the batch is full
                self.dynamic.fill(self, td, timers, acc, iteration)
            else:
                self.put_prompts(td)
                with timers("rollout"):
                    self.rollout(td, iteration)
                with timers("rule_reward"):
                    self.reward(td, acc)
            if self.critic is None:
                with timers("adv"):
                    self.advantages(td)
            if self.s.reference is not None:
                with timers("reference_model"):
                    self.logprobs(td, "ref_log_prob", "ref_log_prob", s.reference, rl.ref_dispatch_size,
                                  rl.ref_forward_micro_batch_size)
            if not self.skip_old_logprobs:
                with timers("old_log_p"):
                    self.logprobs(td, "actor_log_prob", "old_log_prob", s.actor, rl.actor_logprob_dispatch_size,
                                  rl.actor_forward_micro_batch_size)
            if self.critic is not None:  # PPO: values, then GAE on them, then the critic's own update
                with timers("critic_model"):
                    self.critic.compute_values(td)
                with timers("adv"):
                    self.critic.advantages(td, acc, self.kl_ctrl)
                with timers("update_critic"):
                    self.critic.update(td, acc, iteration)
            with timers("update"):
                self.update(td, acc, iteration)
        metrics = acc.reduce()
        metrics.update(self.data_metrics(td))
        metrics.update(timers.metrics())
        if self.dynamic is not None:
            metrics.update(self.dynamic.metrics())
        gen = self.dynamic.num_gen_batches if self.dynamic is not None else 1
        metrics.update(compute_tps(metrics, global_batch_size=self.gbs, n_samples_per_prompt=self.n,
                                   world_size=self.layout.num_devices, log_max_throughput=rl.log_max_throughput,
                                   num_gen_batches=gen, update_batch_size=self.train_rows // self.n))
        current_kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
        self.kl_ctrl.update(current_kl, self.train_rows)
        metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    # ---- stages ------------------------------------------------------------------------------
    def put_prompts(self, td: TransferDock) -> None:
        items = [self.s.dataset[i] for i in self.s.sampler.next_batch()]
        prompts = [torch.as_tensor(it["prompts"], dtype=torch.long) for it in items]
        td.put_prompts({"prompts": prompts, "prompt_length": [len(p) for p in prompts],
                        "labels": [torch.as_tensor(it.get("labels", []), dtype=torch.long) for it in items]})

    def rollout(self, td: TransferDock, iteration: int) -> None:
        sampling = self.s.sampling_for(iteration)
        while not td.all_consumed("actor_rollout"):
            batch, idx = td.get("actor_rollout", ["prompts"], self.cfg.rl.actor_rollout_dispatch_size,
                                get_n_samples=True)
            unique = [batch["prompts"][k].tolist() for k in range(0, len(idx), self.n)]
            outs = self.s.rollout.generate(unique, self.n, sampling, self.s.stop_token_ids)
            responses = [torch.tensor(o.token_ids, dtype=torch.long) for group in outs for o in group]
            td.put(["responses", "response_length"], idx, [responses, [len(r) for r in responses]])

    def reward(self, td: TransferDock, acc: MetricAccumulator) -> None:
        from posttrain.reward.decoding import decode_labels, decode_responses

        while not td.all_consumed("rule_reward"):
            batch, idx = td.get("rule_reward", ["responses", "labels", "response_length"],
                                self.cfg.rl.reward_dispatch_size)
            texts = decode_responses(self.s.tokenizer, [r.tolist() for r in batch["responses"]])
            labels = decode_labels(self.s.tokenizer, [r.tolist() for r in batch["labels"]])
            lengths = [int(x) for x in batch["response_length"]]
            result = self.s.rule_reward.score_detailed(texts, labels, response_lengths=lengths)
            td.put(["rm_scores"], idx, [torch.tensor(result.scores, dtype=torch.float32)])
            names, per_verifier = score_columns(td, result.per_verifier)  # DAPO's filter metric, when the dock has it
            if names:
                td.put(names, idx, per_verifier)
            acc.update(result.metrics)

    def advantages(self, td: TransferDock) -> None:
        rl = self.cfg.rl
        while not td.all_consumed("compute_advantage"):
            batch, idx = td.get("compute_advantage", ["rm_scores", "response_length"], rl.adv_dispatch_size,
                                get_n_samples=True)
            lengths = [int(x) for x in batch["response_length"]]
            mask = per_token([torch.ones(n) for n in lengths], max(max(lengths), 1))
            scores = torch.cat([r.reshape(-1) for r in batch["rm_scores"]])
            rewards = scores_to_token_level_rewards(scores, mask)
            adv, returns = self.estimator(rewards, mask, group_size=self.n, gamma=rl.gamma, lam=rl.lam)
            td.put(["advantages", "returns"], idx, [unpad(adv, lengths), unpad(returns, lengths)])

    def logprobs(self, td: TransferDock, consumer: str, column: str, engine, dispatch: int,
                 micro_batch_size: int | None) -> None:
        temperature = self.cfg.generate.sampling_config.temperature or 1.0
        while not td.all_consumed(consumer):
            batch, idx = td.get(consumer, ["prompts", "responses", "response_length"], dispatch)
            tensors = sequence_batch(batch["prompts"], batch["responses"], self.s.pad_token_id)
            tensors = {k: v.to(self.s.device) for k, v in tensors.items()}
            lp = engine.compute_logprobs(tensors, temperature=temperature, micro_batch_size=micro_batch_size)
            td.put([column], idx, [unpad(lp.float(), [int(x) for x in batch["response_length"]])])

    def update(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        rl = self.cfg.rl
        columns = ["prompts", "responses", "advantages"]
        if not self.skip_old_logprobs:
            columns.append("old_log_prob")
        kl_in_loss = self.s.reference is not None and self.bundle.kl_in_loss  # PPO: the KL is in the reward
        if kl_in_loss:
            columns.append("ref_log_prob")
        loss_fn = self.s.actor_loss_fn(self.bundle, self.kl_ctrl.value if kl_in_loss else 0.0)
        while not td.all_consumed("actor_train"):
            batch, _ = td.get("actor_train", columns, rl.actor_update_dispatch_size)
            tensors = sequence_batch(batch["prompts"], batch["responses"], self.s.pad_token_id)
            width = tensors["response_mask"].shape[1]
            tensors["advantages"] = per_token(batch["advantages"], width)
            if "old_log_prob" in batch:
                tensors["old_logprobs"] = per_token(batch["old_log_prob"], width)
            if "ref_log_prob" in batch:
                tensors["ref_logprobs"] = per_token(batch["ref_log_prob"], width)
            tensors = {k: v.to(self.s.device) for k, v in tensors.items()}
            steps = self.s.actor.update(tensors, loss_fn, mini_batch_size=rl.mini_batch_size * self.n,
                                        epochs=rl.epochs, shuffle=rl.shuffle_mini_batch,
                                        seed=self.cfg.actor.seed + iteration)
            for step in steps:
                acc.update(step)
                if not all(math.isfinite(v) for v in step.values()):
                    log.warning("non-finite metric in update step: %s", step)

    def data_metrics(self, td: TransferDock) -> dict[str, float]:
        batch, _ = td.get("critic_train", ["rm_scores", "response_length", "prompt_length"],
                          indexes=list(range(td.max_len)))
        scores = torch.cat([r.reshape(-1) for r in batch["rm_scores"]])
        max_tokens = self.cfg.generate.sampling_config.max_tokens
        out = score_metrics(scores, self.bundle.metric_prefix)
        out.update(response_length_metrics(torch.cat(batch["response_length"]), max_tokens))
        out.update(prompt_length_metrics(torch.cat(batch["prompt_length"])))
        return out


