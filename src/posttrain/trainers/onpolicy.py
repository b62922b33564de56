"""The on-policy loop (GRPO, DAPO, PPO): one iteration reads like the algorithm.

    put prompts (x n) -> rollout -> reward -> advantages -> reference logprobs -> old logprobs -> update

The reward is the rule verifiers' score and/or a reward model's (``reward_config``), by weight.

Every phase reads its inputs from the TransferDock and writes its outputs back, in the read sizes
of the plan (:mod:`posttrain.trainers.experience` has the dock's schema). What differs between the
algorithms is in the plan's stage (:mod:`posttrain.config.stages`); PPO adds the critic phases of
:mod:`posttrain.trainers.ppo` and DAPO the dynamic sampling of :mod:`posttrain.trainers.dynamic_sampling`.
"""

from __future__ import annotations

import logging

import torch

from posttrain.algo.advantages import compute_advantages, scores_to_token_level_rewards
from posttrain.algo.kl import build_kl_controller
from posttrain.config.plan import Plan
from posttrain.config.run import RunConfig
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import compute_tps, data_metrics, stat_metrics
from posttrain.metrics.timers import Timers
from posttrain.trainers.dynamic_sampling import DynamicSampler, score_columns
from posttrain.trainers.experience import MULTI_TURN_COLUMNS, new_dock, per_group, read_batch, write_rows
from posttrain.trainers.ppo import CriticPhases
from posttrain.trainers.session import Session, check_finite_step
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)



class OnPolicyTrainer:
    def __init__(self, cfg: RunConfig, plan: Plan, session: Session):
        self.cfg, self.plan, self.s = cfg, plan, session
        rl = cfg.rl
        self.n, self.gbs = plan.n, plan.prompts_per_iteration
        self.kl_ctrl = build_kl_controller(rl.kl_ctrl_type, init_kl_coef=rl.init_kl_coef, kl_target=rl.kl_target,
                                           kl_horizon=rl.kl_horizon)
        if "kl_ctrl" in session.trainer_state:
            self.kl_ctrl.load_state_dict(session.trainer_state["kl_ctrl"])
        self.critic = CriticPhases(cfg, plan, session) if plan.uses_critic else None
        self.extra = MULTI_TURN_COLUMNS if rl.multi_turn_enable else ()  # the tool-token mask, tool_call_num
        self.dynamic = DynamicSampler(rl, self.gbs, cfg.actor.seed, carry=self.extra) if plan.dynamic_sampling else None

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        s, last = self.s, {}
        try:
            for iteration in range(s.iteration + 1, self.plan.train_iters + 1):
                last = self.train_step(iteration)
                s.after_iteration(iteration, last, {"kl_ctrl": self.kl_ctrl.state_dict()})
            s.finish({"kl_ctrl": self.kl_ctrl.state_dict()})
        finally:
            s.close()
        return last

    def train_step(self, iteration: int) -> dict[str, float]:
        rl, s, plan = self.cfg.rl, self.s, self.plan
        timers, acc = Timers(), MetricAccumulator()
        td = new_dock(plan.rows_per_update, self.n, guarantee_order=rl.guarantee_order,
                      seed=self.cfg.actor.seed + iteration, extra_columns=self.extra)
        with timers("all"):
            if self.dynamic is not None:  # DAPO: generate and filter until the batch is full
                self.dynamic.fill(self.generate_and_score, td, timers, acc, iteration)
            else:
                self.generate_and_score(td, iteration, timers, acc)
            if self.critic is None:
                with timers("adv"):
                    self.advantages(td)
            if s.policy.reference is not None:
                with timers("reference_model"):
                    self.logprobs(td, "ref_logprobs", s.policy.reference, plan.reads["ref_dispatch_size"],
                                  rl.ref_forward_micro_batch_size)
            if not plan.skip_old_logprobs:
                with timers("old_log_p"):
                    self.logprobs(td, "old_logprobs", s.policy.actor, plan.reads["actor_logprob_dispatch_size"],
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
        return self.iteration_metrics(td, acc, timers)

    def iteration_metrics(self, td: TransferDock, acc: MetricAccumulator, timers: Timers) -> dict[str, float]:
        rl, plan = self.cfg.rl, self.plan
        batch, _ = td.get("metrics", ["scores", "response_length", "prompt_length"], indexes=list(range(td.max_len)))
        metrics = acc.reduce()
        metrics.update(data_metrics(torch.cat(batch["scores"]), torch.cat(batch["response_length"]),
                                    torch.cat(batch["prompt_length"]), algorithm=plan.stage.metric_prefix,
                                    max_response_length=self.cfg.generate.sampling_config.max_tokens))
        metrics.update(timers.metrics())
        if self.extra:  # multi-turn: calls per sample, and the engine's tool counters (timing/tool, tool/*)
            calls, _ = td.get("metrics", ["tool_call_num"], indexes=list(range(td.max_len)))
            metrics.update(stat_metrics("tool_call_num", torch.cat(calls["tool_call_num"])))
        pop = getattr(self.s.policy.rollout, "pop_metrics", None)
        if pop is not None:
            metrics.update(pop())
        if self.dynamic is not None:
            metrics.update(self.dynamic.metrics())
        gen = self.dynamic.num_gen_batches if self.dynamic is not None else 1
        metrics.update(compute_tps(metrics, global_batch_size=self.gbs, n_samples_per_prompt=self.n,
                                   world_size=plan.layout.num_devices, log_max_throughput=rl.log_max_throughput,
                                   num_gen_batches=gen, update_batch_size=plan.prompts_per_update))
        current_kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
        self.kl_ctrl.update(current_kl, plan.rows_per_update)
        metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    # ---- phases ------------------------------------------------------------------------------
    def generate_and_score(self, td: TransferDock, iteration: int, timers: Timers, acc: MetricAccumulator) -> None:
        """Fill ``td`` with prompts, sample their responses (seeded by ``iteration``) and score them."""
        self.put_prompts(td)
        with timers("rollout"):
            self.rollout(td, iteration)
        self.reward(td, acc, timers)

    def put_prompts(self, td: TransferDock) -> None:
        items = [self.s.dataset[i] for i in self.s.sampler.next_batch()]
        prompts = [torch.as_tensor(it["prompts"], dtype=torch.long) for it in items]
        td.put_prompts({"prompts": prompts, "prompt_length": [len(p) for p in prompts],
                        "labels": [torch.as_tensor(it.get("labels", []), dtype=torch.long) for it in items]})

    def rollout(self, td: TransferDock, iteration: int) -> None:
        """Sample each prompt's ``n`` responses. A prompt's random stream is keyed by its group in
        the dock (row // n: its index in the iteration's batch), so the samples do not depend on
        the dispatch size, the dock's read order or the number of workers."""
        p, sampling = self.s.policy, self.s.sampling_for(iteration)
        while not td.all_consumed("rollout"):
            batch, idx = td.get("rollout", ["prompts"], self.plan.reads["actor_rollout_dispatch_size"],
                                get_n_samples=True)
            unique = [batch["prompts"][k].tolist() for k in range(0, len(idx), self.n)]
            keys = [idx[k] // self.n for k in range(0, len(idx), self.n)]
            outs = [o for group in p.rollout.generate(unique, self.n, sampling, p.stop_token_ids, prompt_keys=keys)
                    for o in group]
            responses = [torch.tensor(o.token_ids, dtype=torch.long) for o in outs]
            td.put(["responses", "response_length"], idx, [responses, [len(r) for r in responses]])
            if self.extra:  # the sampled tokens' mask (0 on tool tokens) and the calls of each sample
                td.put(list(MULTI_TURN_COLUMNS), idx, [[torch.tensor(o.response_mask, dtype=torch.long) for o in outs],
                                                      [o.tool_call_num for o in outs]])

    def reward(self, td: TransferDock, acc: MetricAccumulator, timers: Timers | None = None) -> None:
        """Each response's score: the rule reward (``rl_config.rule_reward``, timed as ``rule_reward``)
        plus ``rl_config.reward_model_weight`` x the reward model's score (``reward_config``, timed as
        ``reward_model``, logged as ``reward_model/score/{mean,max,min}``)."""
        timers = timers if timers is not None else Timers()
        model = self.s.reward_model
        while not td.all_consumed("reward"):
            batch, idx = td.get("reward", ["prompts", "responses", "labels", "response_length",
                                           *(["tool_call_num"] if self.extra else [])],
                                self.plan.reads["reward_dispatch_size"])
            scores = [0.0] * len(idx)
            if self.cfg.rl.rule_reward:
                with timers("rule_reward"):
                    scores = self.rule_scores(td, batch, idx, acc)
            if model is not None:
                with timers("reward_model"):
                    model_scores = model.score_sequences([p.tolist() for p in batch["prompts"]],
                                                         [r.tolist() for r in batch["responses"]])
                weight = self.plan.reward_model.weight
                scores = [score + weight * m for score, m in zip(scores, model_scores)]
                acc.update({f"reward_model/score/{k}": model_scores for k in ("mean", "max", "min")})
            td.put(["scores"], idx, [torch.tensor(scores, dtype=torch.float32)])

    def rule_scores(self, td: TransferDock, batch: dict, idx: list[int], acc: MetricAccumulator) -> list[float]:
        """The rule verifiers' weighted scores of one read (and DAPO's per-verifier filter column)."""
        from posttrain.reward.decoding import decode_labels, decode_responses

        tokenizer = self.s.policy.tokenizer
        texts = decode_responses(tokenizer, [r.tolist() for r in batch["responses"]])
        labels = decode_labels(tokenizer, [r.tolist() for r in batch["labels"]])
        lengths = [int(x) for x in batch["response_length"]]
        columns = {"tool_call_num": [int(x) for x in batch["tool_call_num"]]} if "tool_call_num" in batch else {}
        result = self.s.rule_reward.score_detailed(texts, labels, response_lengths=lengths, **columns)
        names, per_verifier = score_columns(td, result.per_verifier)  # DAPO's filter metric, when the dock has it
        if names:
            td.put(names, idx, per_verifier)
        acc.update(result.metrics)
        return list(result.scores)

    def advantages(self, td: TransferDock) -> None:
        rl = self.cfg.rl
        while not td.all_consumed("advantages"):
            batch, idx = td.get("advantages", ["scores", "response_length"], self.plan.reads["adv_dispatch_size"],
                                get_n_samples=True)
            lengths, mask = per_group(batch)
            scores = torch.cat([r.reshape(-1) for r in batch["scores"]])
            rewards = scores_to_token_level_rewards(scores, mask)
            adv, returns = compute_advantages(rl.adv_estimator, rewards, mask, group_size=self.n, gamma=rl.gamma,
                                              lam=rl.lam)
            write_rows(td, ["advantages", "returns"], idx, [adv, returns], lengths)

    def logprobs(self, td: TransferDock, column: str, engine, count: int, micro_batch_size: int | None) -> None:
        """``column`` (``ref_logprobs`` or ``old_logprobs``): the response log-probs under ``engine``."""
        while not td.all_consumed(column):
            batch, idx, lengths = read_batch(td, column, [], count, pad_token_id=self.s.policy.pad_token_id,
                                             device=self.s.device)
            lp = engine.compute_logprobs(batch, temperature=self.plan.logprob_temperature,
                                         micro_batch_size=micro_batch_size)
            write_rows(td, [column], idx, [lp], lengths)

    def update(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        from posttrain.train.loss_fns import make_actor_loss_fn

        rl, plan, s = self.cfg.rl, self.plan, self.s
        columns = ["advantages"]
        if not plan.skip_old_logprobs:
            columns.append("old_logprobs")
        kl_in_loss = s.policy.reference is not None and plan.stage.kl_in_loss  # PPO: the KL is in the reward
        if kl_in_loss:
            columns.append("ref_logprobs")
        loss_fn = make_actor_loss_fn(kl_coef=self.kl_ctrl.value if kl_in_loss else 0.0, **plan.actor_loss)
        while not td.all_consumed("actor_update"):
            batch, _, _ = read_batch(td, "actor_update", columns, plan.reads["actor_update_dispatch_size"],
                                     pad_token_id=s.policy.pad_token_id, device=s.device)
            steps = s.policy.actor.update(batch, loss_fn, mini_batch_size=plan.mini_batch_rows, epochs=rl.epochs,
                                          shuffle=rl.shuffle_mini_batch, seed=self.cfg.actor.seed + iteration)
            for step in steps:
                check_finite_step(step, iteration)
                acc.update(step)
