"""The on-policy loop (GRPO, DAPO, PPO): one iteration reads like the algorithm.

    experience (prompts x n -> rollout -> reward) -> advantages -> [image embeddings] -> reference
        logprobs -> (teacher logprobs) -> old logprobs -> rollout correction -> update -> publish the weights

(image embeddings: a multimodal run with ``reuse_image_embeds``, :mod:`posttrain.loops.multimodal`;
teacher logprobs: on-policy distillation, ``rl_config.teacher_model``.)

The experience comes from the plan's :class:`~posttrain.loops.sources.ExperienceSource`:
produced now with the trainer's weights, or ahead by a rollout thread with weights up to
``async_staleness`` updates old (docs/async.md); how it is produced (plain or partial rollout,
DAPO's dynamic sampling, the reward) is :mod:`posttrain.loops.produce`. The loop learns from it.

Every phase reads its inputs from the TransferDock and writes its outputs back, in the read sizes
of the plan (:mod:`posttrain.loops.experience` has the dock's schema). What differs between the
algorithms is in the plan's stage (:mod:`posttrain.config.stages`); PPO adds the critic phases of
:mod:`posttrain.loops.ppo`.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from posttrain.algo.advantages import compute_advantages, scores_to_token_level_rewards
from posttrain.algo.distill import distill_advantages
from posttrain.algo.kl import build_kl_controller
from posttrain.algo.rollout_correction import rollout_correction
from posttrain.algo.turn_credit import turn_level_advantages
from posttrain.config.plan import Plan
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import compute_tps, data_metrics, stat_metrics
from posttrain.metrics.timers import Timers
from posttrain.training.engine import release_gradients_of
from posttrain.training.loss_fns import make_actor_loss_fn
from posttrain.loops.dump_points import dump_experience, dumped_phase
from posttrain.loops.experience import per_group, per_token, read_batch, write_rows
from posttrain.loops.multimodal import compute_image_embeds, image_embedder
from posttrain.loops.overlap import overlapped_passes
from posttrain.loops.ppo import CriticPhases
from posttrain.loops.produce import Experience, Producer
from posttrain.loops.session import Session, check_finite_step
from posttrain.loops.sources import ExperienceSource, open_source
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)


class OnPolicyTrainer:
    def __init__(self, plan: Plan, session: Session):
        self.plan, self.s = plan, session
        kl = plan.kl
        self.kl_ctrl = build_kl_controller(kl.ctrl_type, init_kl_coef=kl.init_kl_coef, kl_target=kl.target,
                                           kl_horizon=kl.horizon)
        if "kl_ctrl" in session.trainer_state:
            self.kl_ctrl.load_state_dict(session.trainer_state["kl_ctrl"])
        self.critic = CriticPhases(plan, session) if plan.uses_critic else None
        self.producer = Producer(plan, session)
        self.source: ExperienceSource | None = None  # opened by the first iteration (a rollout thread starts)
        # multimodal: images per vision-tower forward in the log-prob passes and the update
        self.vit_micro_batch_size = plan.multimodal.vit_micro_batch_size if plan.multimodal else None

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        s, last = self.s, {}
        try:
            self.source = self.source or open_source(self.plan, s, self.producer)
            for iteration in range(s.iteration + 1, self.plan.train_iters + 1):
                last = self.train_step(iteration)
                with self.checkpoint_files(iteration):
                    s.after_iteration(iteration, last, self.state())
            with self.checkpoint_files():
                s.finish(self.state())
        finally:
            if self.source is not None:
                self.source.close()
            s.close()
        return last

    def state(self) -> dict:
        """The loop's JSON state in a checkpoint."""
        off = self.plan.off_policy
        return {"kl_ctrl": self.kl_ctrl.state_dict(), "async_staleness": off.staleness,
                "in_flight_saved": bool(off.pipelined),  # a resume refuses to drop them (loops.resume_files)
                "partial_rollout_max_split": off.partial_max_split if off.partial else None}

    def train_step(self, iteration: int) -> dict[str, float]:
        timers, acc = Timers(around=self.s.phase), MetricAccumulator()
        if self.source is None:
            self.source = open_source(self.plan, self.s, self.producer)
        with self.s.profiler.step(iteration), self.s.dumps.step(iteration), timers("all"):
            with dumped_phase(self.s, self.s.dumps, "rollout"):  # the producer times its own phases
                exp = self.source.next(iteration, timers)
            timers.merge(exp.timers)
            acc.merge(exp.acc)
            self.learn(exp.td, iteration, timers, acc)
            self.release_gradients()
            self.source.publish(iteration, self.s.policy.model, timers)
        return self.iteration_metrics(exp, acc, timers, iteration)

    def release_gradients(self) -> None:
        """Free the actor's (and the critic's) gradients after the update: nothing reads them before
        the next update's backward, and the rollout in between would carry a copy of the trained
        weights' size (Ray workers free theirs through ``ActorRole``; engines that keep their gradients
        in place, Megatron's, have no ``release_gradients``)."""
        release_gradients_of(self.s.policy.actor, getattr(self.s.critic, "engine", None))

    @contextlib.contextmanager
    def checkpoint_files(self, iteration: int | None = None):
        """Around :meth:`Session.after_iteration` (``iteration``) or the final save (None): when it
        saves or evaluates, the checkpoint gets the source's state beyond the weights."""
        if iteration is not None and not self.s.saves_or_evaluates(iteration):
            yield
            return
        with self.source.checkpoint_files() as files:
            self.s.extra_files.update(files)
            try:
                yield
            finally:
                for name in files:
                    self.s.extra_files.pop(name, None)

    # ---- learning from the experience ---------------------------------------------------------
    def learn(self, td: TransferDock, iteration: int, timers: Timers, acc: MetricAccumulator) -> None:
        """Advantages, reference and old log-probs, the rollout correction, the critic (PPO), the update."""
        s, plan = self.s, self.plan
        if self.critic is None:
            with timers("adv"):
                self.advantages(td)
        overlap = bool(plan.separated) and not plan.separated.blocking  # the separated roles' passes started together (loops/overlap.py)
        mm = plan.multimodal
        if mm is not None and mm.reuse_image_embeds:  # the vision tower once; every pass reads its embeddings
            with timers("image_embeds"):
                compute_image_embeds(td, image_embedder(s.policy, s.device, mm.vit_micro_batch_size),
                                     mm.embeds_dispatch_size)
        if overlap:
            overlapped_passes(self, td, timers)
        if s.policy.reference is not None and not overlap:
            with timers("reference_model"):
                self.logprobs(td, "ref_logprobs", s.policy.reference, plan.reads["ref_dispatch_size"],
                              plan.update.ref_micro_batch_size)
            for name, start, end in getattr(s.policy.reference, "pop_moves", list)():  # offload_reference
                acc.update({name: end - start})  # plain durations: summed over the iteration's moves
        if s.policy.teacher is not None:  # on-policy distillation: the teacher scores the samples
            with timers("teacher_model"):
                self.logprobs(td, "teacher_logprobs", s.policy.teacher, plan.reads["ref_dispatch_size"],
                              plan.update.ref_micro_batch_size)
        if not plan.skip_old_logprobs:
            if not overlap:
                with timers("old_log_p"):
                    self.logprobs(td, "old_logprobs", s.policy.actor, plan.reads["actor_logprob_dispatch_size"],
                                  plan.update.old_micro_batch_size)
            self.correct(td, acc, iteration)
        if self.critic is not None:  # PPO: values, then GAE on them, then the critic's own update
            if not overlap:
                with timers("critic_model"):
                    self.critic.compute_values(td)
            with timers("adv"):
                self.critic.advantages(td, acc, self.kl_ctrl, timers)
            with timers("update_critic"):
                self.critic.update(td, acc, iteration)
        dump_experience(s.dumps, td)  # msprobe_config.key_data_dump
        with timers("update"):
            self.update(td, acc, iteration)

    def iteration_metrics(self, exp: Experience, acc: MetricAccumulator, timers: Timers,
                          iteration: int) -> dict[str, float]:
        plan, td = self.plan, exp.td
        rows = list(range(td.max_len))
        batch, _ = td.get("metrics", ["scores", "response_length", "prompt_length", "policy_version"], indexes=rows)
        metrics = acc.reduce()
        metrics.update(data_metrics(torch.cat(batch["scores"]), torch.cat(batch["response_length"]),
                                    torch.cat(batch["prompt_length"]), algorithm=plan.stage.metric_prefix,
                                    max_response_length=plan.rollout.sampling.max_tokens))
        metrics.update(timers.metrics())
        if plan.off_policy.any:  # how many versions the samples lag the trained weights
            staleness = (iteration - 1) - torch.cat(batch["policy_version"]).float()
            metrics.update({"rollout/staleness_mean": staleness.mean().item(),
                            "rollout/staleness_max": staleness.max().item()})
        if self.producer.extra:  # multi-turn: calls per sample
            calls, _ = td.get("metrics", ["tool_call_num"], indexes=rows)
            metrics.update(stat_metrics("tool_call_num", torch.cat(calls["tool_call_num"])))
        metrics.update(exp.metrics)  # the engine's tool counters (timing/tool, tool/*), dynamic sampling's
        metrics.update(compute_tps(metrics, global_batch_size=plan.prompts_per_iteration, n_samples_per_prompt=plan.n,
                                   world_size=plan.layout.num_devices, log_max_throughput=plan.logging.log_max_throughput,
                                   num_gen_batches=exp.num_gen_batches, update_batch_size=plan.prompts_per_update))
        current_kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
        self.kl_ctrl.update(current_kl, plan.rows_per_update)
        metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    # ---- phases ------------------------------------------------------------------------------
    def advantages(self, td: TransferDock) -> None:
        """Each row's advantages and returns, per trajectory or, with ``turn_credit: turn``, per
        assistant turn (:mod:`posttrain.algo.turn_credit`, on the tool-token mask)."""
        adv = self.plan.advantages
        per_turn = adv.turn_credit == "turn"
        columns = ["scores", "response_length", *(["response_mask"] if per_turn else [])]
        while not td.all_consumed("advantages"):
            batch, idx = td.get("advantages", columns, self.plan.reads["adv_dispatch_size"], get_n_samples=True)
            lengths, mask = per_group(batch)
            scores = torch.cat([r.reshape(-1) for r in batch["scores"]])
            if per_turn:
                mask = mask * per_token(batch["response_mask"], mask.shape[1])
                values, returns = turn_level_advantages(adv.estimator, scores, mask, group_size=self.plan.n,
                                                        gamma=adv.gamma)
            else:
                rewards = scores_to_token_level_rewards(scores, mask)
                values, returns = compute_advantages(adv.estimator, rewards, mask, group_size=self.plan.n,
                                                     gamma=adv.gamma, lam=adv.lam)
            write_rows(td, ["advantages", "returns"], idx, [values, returns], lengths)

    def logprobs(self, td: TransferDock, column: str, engine, count: int, micro_batch_size: int | None) -> None:
        """``column`` (``ref_logprobs`` or ``old_logprobs``): the response log-probs under ``engine``."""
        while not td.all_consumed(column):
            batch, idx, lengths = read_batch(td, column, [], count, pad_token_id=self.s.policy.pad_token_id,
                                             device=self.s.device, vit_micro_batch_size=self.vit_micro_batch_size)
            lp = engine.compute_logprobs(batch, temperature=self.plan.logprob_temperature,
                                         micro_batch_size=micro_batch_size)
            write_rows(td, [column], idx, [lp], lengths)

    def distilled(self, batch: dict[str, torch.Tensor], acc: MetricAccumulator) -> torch.Tensor:
        """On-policy distillation's advantages (:mod:`posttrain.algo.distill`): the reverse-KL term
        from the teacher's and the sampling policy's log-probs of each sampled token, alone or (mode
        ``mixed``) added to the task reward's advantages."""
        d = self.plan.distill
        advantages, metrics = distill_advantages(d.mode, batch["rollout_logprobs"], batch["teacher_logprobs"],
                                                 batch["response_mask"], coef=d.coef,
                                                 task_advantages=batch["advantages"])
        acc.update(metrics)
        return advantages

    def correct(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        """Compare the rollout's log-probs with the trainer's old ones (``rollout/*`` metrics), and
        with ``rl_config.rollout_correction`` put the per-token weights the update applies. With
        ``async_staleness`` a sample more than ``k`` versions old is dropped here (weight 0)."""
        off = self.plan.off_policy
        batch, idx, lengths = read_batch(td, "rollout_correction", ["old_logprobs", "rollout_logprobs"], None,
                                         pad_token_id=self.s.policy.pad_token_id,
                                         indexes=range(td.max_len))  # in order: the dock's row-choice draws stay the update's
        weights, mask, metrics = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"],
                                                    batch["response_mask"], mode=off.correction,
                                                    cap=off.correction_cap, level=off.correction_level,
                                                    floor=off.correction_floor)
        acc.update(metrics)
        weights = weights * mask
        limit = off.staleness_limit
        if limit is not None:  # admission: a sample older than the limit is not trained on
            versions, _ = td.get("rollout_correction", ["policy_version"], indexes=idx)
            stale = torch.tensor([(iteration - 1) - int(v) > limit for v in versions["policy_version"]])
            weights[stale] = 0.0
            acc.update({"rollout/dropped_stale": float(stale.sum())})
        if off.weighted_update:
            write_rows(td, ["rollout_weights"], idx, [weights], lengths)

    def update(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        plan, s, u = self.plan, self.s, self.plan.update
        columns = ["advantages"]
        if not plan.skip_old_logprobs:
            columns.append("old_logprobs")
        kl_in_loss = s.policy.reference is not None and plan.stage.kl_in_loss  # PPO: the KL is in the reward
        if kl_in_loss:
            columns.append("ref_logprobs")
        if plan.off_policy.weighted_update:
            columns.append("rollout_weights")
        if plan.distill is not None:
            columns += ["teacher_logprobs", "rollout_logprobs"]
        loss_fn = s.dumps.watch_loss(make_actor_loss_fn(plan.actor_loss, kl_coef=self.kl_ctrl.value if kl_in_loss
                                                        else 0.0))
        while not td.all_consumed("actor_update"):
            batch, _, _ = read_batch(td, "actor_update", columns, plan.reads["actor_update_dispatch_size"],
                                     pad_token_id=s.policy.pad_token_id, device=s.device,
                                     vit_micro_batch_size=self.vit_micro_batch_size)
            if plan.distill is not None:
                batch["advantages"] = self.distilled(batch, acc)
            steps = s.policy.actor.update(batch, loss_fn, mini_batch_size=plan.mini_batch_rows, epochs=u.epochs,
                                          shuffle=u.shuffle, seed=u.seed + iteration)
            for step in steps:
                check_finite_step(step, iteration)
                s.dumps.record_scalars("key_data", step)
                acc.update(step)
