"""The on-policy loop (GRPO, DAPO, PPO): one iteration reads like the algorithm.

    put prompts (x n) -> rollout -> reward -> advantages -> reference logprobs -> old logprobs
        -> rollout correction -> update

The first three phases produce the iteration's :class:`Experience`; the rest learn from it. With
``rl_config.async_staleness`` a thread produces the next iterations' experience on a copy of the
weights while this one learns (:mod:`posttrain.trainers.pipeline`, docs/async.md).

The reward is the rule verifiers' score and/or a reward model's (``reward_config``), by weight.

Every phase reads its inputs from the TransferDock and writes its outputs back, in the read sizes
of the plan (:mod:`posttrain.trainers.experience` has the dock's schema). What differs between the
algorithms is in the plan's stage (:mod:`posttrain.config.stages`); PPO adds the critic phases of
:mod:`posttrain.trainers.ppo` and DAPO the dynamic sampling of :mod:`posttrain.trainers.dynamic_sampling`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.algo.advantages import compute_advantages, scores_to_token_level_rewards
from posttrain.algo.kl import build_kl_controller
from posttrain.algo.rollout_correction import rollout_correction
from posttrain.config.plan import Plan, off_policy
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import compute_tps, data_metrics, stat_metrics
from posttrain.metrics.timers import Timers
from posttrain.trainers.dynamic_sampling import DynamicSampler, score_columns
from posttrain.trainers.experience import MULTI_TURN_COLUMNS, new_dock, per_group, read_batch, write_rows
from posttrain.trainers.ppo import CriticPhases
from posttrain.trainers.session import Session, check_finite_step
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)
IN_FLIGHT = "in_flight.pt"  # async: the finished experiences a checkpoint saves


@dataclass
class Experience:
    """One iteration's prompts, samples and scores in their TransferDock, and what producing them
    measured: phase timers, reward metrics, and the engine's and dynamic sampling's metrics."""

    td: TransferDock
    timers: Timers = field(default_factory=Timers)
    acc: MetricAccumulator = field(default_factory=MetricAccumulator)
    metrics: dict[str, float] = field(default_factory=dict)
    num_gen_batches: int = 1


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
        self.pipeline = None  # async_staleness: the rollout thread, started by fit()
        self.partial = self.partial_pool() if rl.partial_rollout_max_split > 1 else None

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        s, last = self.s, {}
        try:
            if self.cfg.rl.async_staleness is not None or not self.cfg.rl.use_integrated_worker:
                self.pipeline = self.start_pipeline()
            for iteration in range(s.iteration + 1, self.plan.train_iters + 1):
                last = self.train_step(iteration)
                with self.checkpoint_files(iteration):
                    s.after_iteration(iteration, last, self.state())
            with self.checkpoint_files():
                s.finish(self.state())
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
            s.close()
        return last

    def partial_pool(self):
        """The partial-rollout dock, resumed from the checkpoint's when there is one."""
        from posttrain.trainers.partial_rollout import STATE_FILE, PartialRollout

        rl, s = self.cfg.rl, self.s
        pool = PartialRollout(n=self.n, global_batch_size=self.gbs, max_split=rl.partial_rollout_max_split,
                              max_tokens=self.cfg.generate.sampling_config.max_tokens,
                              max_model_len=self.cfg.generate.max_model_len,
                              require_max_age_all_finished=rl.require_max_age_all_finished)
        path = s.trainer_state.get("checkpoint_dir") if s.iteration else None
        if path and (Path(path) / STATE_FILE).is_file():
            pool.load_state_dict(torch.load(Path(path) / STATE_FILE, weights_only=False))
        return pool

    def state(self) -> dict:
        """The loop's JSON state in a checkpoint."""
        return {"kl_ctrl": self.kl_ctrl.state_dict(), "async_staleness": self.cfg.rl.async_staleness}

    def train_step(self, iteration: int) -> dict[str, float]:
        timers, acc = Timers(), MetricAccumulator()
        with timers("all"):
            if self.pipeline is not None:  # sampled by the rollout thread, with weights up to k updates old
                exp, began, ended = self.pipeline.experience(iteration)
                timers.record("non_overlap_rollout", began, ended)
            else:
                exp = self.produce(iteration, self.s.policy.rollout, iteration - 1)
            timers.merge(exp.timers)
            acc.merge(exp.acc)
            self.learn(exp.td, iteration, timers, acc)
            sync = getattr(self.s.policy.rollout, "sync_weights", None)  # vLLM: its own copy of the weights
            if sync is not None:
                with timers("resharding_to_infer"):
                    sync(self.s.policy.model)
            if self.pipeline is not None:
                with timers("resharding_to_infer"):
                    self.pipeline.publish(iteration, self.s.policy.model)
        return self.iteration_metrics(exp, acc, timers, iteration)

    # ---- producing experience ----------------------------------------------------------------
    def produce(self, iteration: int, engine, version: int) -> Experience:
        """Prompts, their samples (by ``engine``, whose weights are ``version``) and their scores."""
        rl, plan = self.cfg.rl, self.plan
        exp = Experience(new_dock(plan.rows_per_update, self.n, guarantee_order=rl.guarantee_order,
                                  seed=self.cfg.actor.seed + iteration, extra_columns=self.extra))

        def generate_and_score(td, it, timers, acc):
            self.generate_and_score(td, it, timers, acc, engine=engine, version=version)

        if self.dynamic is not None:  # DAPO: generate and filter until the batch is full
            self.dynamic.fill(generate_and_score, exp.td, exp.timers, exp.acc, iteration)
            exp.metrics.update(self.dynamic.metrics())
            exp.num_gen_batches = self.dynamic.num_gen_batches
        else:
            generate_and_score(exp.td, iteration, exp.timers, exp.acc)
        pop = getattr(engine, "pop_metrics", None)
        if pop is not None:  # multi-turn: timing/tool, tool/*
            exp.metrics.update(pop())
        return exp

    def start_pipeline(self):
        """The rollout thread, with a copy of the weights in this process or, with
        ``use_integrated_worker: false``, a rollout worker process on Ray."""
        from posttrain.roles.policy import build_rollout
        from posttrain.trainers.pipeline import LocalReplica, RolloutPipeline

        s, start, rl = self.s, self.s.iteration, self.cfg.rl
        in_flight = {}
        path = s.trainer_state.get("checkpoint_dir")
        if start and path and (Path(path) / IN_FLIGHT).is_file():
            saved = s.trainer_state.get("async_staleness")
            if saved != rl.async_staleness:
                raise ConfigError(f"{path} was saved by a run with rl_config.async_staleness={saved}; resume it with "
                                  f"the same value (its in-flight samples were drawn for it), or start a new run")
            in_flight = torch.load(Path(path) / IN_FLIGHT, weights_only=False)
        p = s.policy
        if rl.use_integrated_worker:
            replica = LocalReplica(p.model, lambda m: build_rollout(self.cfg, self.plan, m, p.tokenizer,
                                                                    p.stop_token_ids))
        else:
            from posttrain.cluster.rollout_worker import RemoteReplica

            replica = RemoteReplica(self.cfg, self.plan, p.model)
        return RolloutPipeline(self.produce, replica, staleness=rl.async_staleness or 0, start=start,
                               last=self.plan.train_iters, in_flight=in_flight)

    @contextlib.contextmanager
    def checkpoint_files(self, iteration: int | None = None):
        """Around :meth:`Session.after_iteration` (``iteration``) or the final save (None): when it
        saves or evaluates, the rollout thread pauses once it has produced all it may (so the
        evaluation has the reward workers to itself), and the checkpoint gets the loop's state
        beyond the weights: the finished experiences not trained on yet, and the partial-rollout dock."""
        if iteration is not None and not self.s.saves_or_evaluates(iteration):
            yield
            return
        with self.pipeline.drained() if self.pipeline is not None else contextlib.nullcontext({}) as finished:
            files = {IN_FLIGHT: finished} if self.pipeline is not None else {}
            if self.partial is not None:
                from posttrain.trainers.partial_rollout import STATE_FILE

                files[STATE_FILE] = self.partial.state_dict()
            self.s.extra_files.update(files)
            try:
                yield
            finally:
                for name in files:
                    self.s.extra_files.pop(name, None)

    # ---- learning from it --------------------------------------------------------------------
    def learn(self, td: TransferDock, iteration: int, timers: Timers, acc: MetricAccumulator) -> None:
        """Advantages, reference and old log-probs, the rollout correction, the critic (PPO), the update."""
        rl, s, plan = self.cfg.rl, self.s, self.plan
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
            self.correct(td, acc, iteration)
        if self.critic is not None:  # PPO: values, then GAE on them, then the critic's own update
            with timers("critic_model"):
                self.critic.compute_values(td)
            with timers("adv"):
                self.critic.advantages(td, acc, self.kl_ctrl)
            with timers("update_critic"):
                self.critic.update(td, acc, iteration)
        with timers("update"):
            self.update(td, acc, iteration)

    def iteration_metrics(self, exp: Experience, acc: MetricAccumulator, timers: Timers,
                          iteration: int) -> dict[str, float]:
        rl, plan, td = self.cfg.rl, self.plan, exp.td
        rows = list(range(td.max_len))
        batch, _ = td.get("metrics", ["scores", "response_length", "prompt_length", "policy_version"], indexes=rows)
        metrics = acc.reduce()
        metrics.update(data_metrics(torch.cat(batch["scores"]), torch.cat(batch["response_length"]),
                                    torch.cat(batch["prompt_length"]), algorithm=plan.stage.metric_prefix,
                                    max_response_length=self.cfg.generate.sampling_config.max_tokens))
        metrics.update(timers.metrics())
        if off_policy(self.cfg):  # how many versions the samples lag the trained weights
            staleness = (iteration - 1) - torch.cat(batch["policy_version"]).float()
            metrics.update({"rollout/staleness_mean": staleness.mean().item(),
                            "rollout/staleness_max": staleness.max().item()})
        if self.extra:  # multi-turn: calls per sample
            calls, _ = td.get("metrics", ["tool_call_num"], indexes=rows)
            metrics.update(stat_metrics("tool_call_num", torch.cat(calls["tool_call_num"])))
        metrics.update(exp.metrics)  # the engine's tool counters (timing/tool, tool/*), dynamic sampling's
        metrics.update(compute_tps(metrics, global_batch_size=self.gbs, n_samples_per_prompt=self.n,
                                   world_size=plan.layout.num_devices, log_max_throughput=rl.log_max_throughput,
                                   num_gen_batches=exp.num_gen_batches, update_batch_size=plan.prompts_per_update))
        current_kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
        self.kl_ctrl.update(current_kl, plan.rows_per_update)
        metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    # ---- phases ------------------------------------------------------------------------------
    def generate_and_score(self, td: TransferDock, iteration: int, timers: Timers, acc: MetricAccumulator, *,
                           engine, version: int) -> None:
        """Fill ``td`` with prompts, sample their responses (seeded by ``iteration``, with ``engine``
        whose weights are ``version``) and score them."""
        if self.partial is not None:  # partial rollout: rounds over two batches of prompts
            with timers("rollout"):
                self.partial_rollout(td, iteration, engine, version, acc)
        else:
            self.put_prompts(td)
            with timers("rollout"):
                self.rollout(td, iteration, engine, version)
        self.reward(td, acc, timers)

    def next_prompts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The next batch of prompts from the sampler, and their labels."""
        items = [self.s.dataset[i] for i in self.s.sampler.next_batch()]
        return ([torch.as_tensor(it["prompts"], dtype=torch.long) for it in items],
                [torch.as_tensor(it.get("labels", []), dtype=torch.long) for it in items])

    def put_prompts(self, td: TransferDock) -> None:
        prompts, labels = self.next_prompts()
        td.put_prompts({"prompts": prompts, "prompt_length": [len(p) for p in prompts], "labels": labels})

    def partial_rollout(self, td: TransferDock, iteration: int, engine, version: int, acc: MetricAccumulator) -> None:
        """Fill the partial-rollout dock's free groups with prompts, run rounds until an update is
        ready, and put the update's groups (oldest first) into ``td``."""
        pool = self.partial
        while len(pool.free_groups()) >= self.gbs:
            prompts, labels = self.next_prompts()
            pool.add_prompts([p.tolist() for p in prompts], labels)
        pool.fill(engine, self.s.sampling_for(iteration), self.s.policy.stop_token_ids, version)
        batch, metrics = pool.take()
        columns = ["prompts", "prompt_length", "labels", "responses", "rollout_logprobs", "policy_version"]
        td.put([*columns, "response_length"], list(range(td.max_len)),
               [batch[c] for c in columns] + [[r.numel() for r in batch["responses"]]])
        acc.update(metrics)

    def rollout(self, td: TransferDock, iteration: int, engine=None, version: int | None = None) -> None:
        """Sample each prompt's ``n`` responses. A prompt's random stream is keyed by its group in
        the dock (row // n: its index in the iteration's batch), so the samples do not depend on
        the dispatch size, the dock's read order or the number of workers."""
        engine = self.s.policy.rollout if engine is None else engine  # default: the actor's weights now
        version = iteration - 1 if version is None else version
        stops, sampling = self.s.policy.stop_token_ids, self.s.sampling_for(iteration)
        while not td.all_consumed("rollout"):
            batch, idx = td.get("rollout", ["prompts"], self.plan.reads["actor_rollout_dispatch_size"],
                                get_n_samples=True)
            unique = [batch["prompts"][k].tolist() for k in range(0, len(idx), self.n)]
            keys = [idx[k] // self.n for k in range(0, len(idx), self.n)]
            outs = [o for group in engine.generate(unique, self.n, sampling, stops, prompt_keys=keys) for o in group]
            responses = [torch.tensor(o.token_ids, dtype=torch.long) for o in outs]
            td.put(["responses", "response_length", "rollout_logprobs", "policy_version"], idx,
                   [responses, [len(r) for r in responses],
                    [torch.tensor(o.logprobs, dtype=torch.float32) for o in outs], [version] * len(idx)])
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

    def correct(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        """Compare the rollout's log-probs with the trainer's old ones (``rollout/*`` metrics), and
        with ``rl_config.rollout_correction`` put the per-token weights the update applies. With
        ``async_staleness`` a sample more than ``k`` versions old is dropped here (weight 0)."""
        rl = self.cfg.rl
        batch, idx, lengths = read_batch(td, "rollout_correction", ["old_logprobs", "rollout_logprobs"], None,
                                         pad_token_id=self.s.policy.pad_token_id,
                                         indexes=range(td.max_len))  # in order: the dock's row-choice draws stay the update's
        weights, mask, metrics = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"],
                                                    batch["response_mask"], mode=rl.rollout_correction,
                                                    cap=rl.rollout_correction_cap, level=rl.rollout_correction_level)
        acc.update(metrics)
        weights = weights * mask
        limit = self.staleness_limit()
        if limit is not None:  # admission: a sample older than the limit is not trained on
            versions, _ = td.get("rollout_correction", ["policy_version"], indexes=idx)
            stale = torch.tensor([(iteration - 1) - int(v) > limit for v in versions["policy_version"]])
            weights[stale] = 0.0
            acc.update({"rollout/dropped_stale": float(stale.sum())})
        if self.weighted_update:
            write_rows(td, ["rollout_weights"], idx, [weights], lengths)

    def staleness_limit(self) -> int | None:
        """The most versions a trained sample may lag the trainer: ``async_staleness`` k, plus
        ``N - 1`` for a sample continued over ``partial_rollout_max_split`` N iterations; None when
        neither is on."""
        rl = self.cfg.rl
        if rl.async_staleness is None and self.partial is None:
            return None
        return (rl.async_staleness or 0) + rl.partial_rollout_max_split - 1

    @property
    def weighted_update(self) -> bool:
        """Whether the update reads ``rollout_weights`` (a correction, or the staleness admission)."""
        return self.cfg.rl.rollout_correction != "none" or self.staleness_limit() is not None

    def update(self, td: TransferDock, acc: MetricAccumulator, iteration: int) -> None:
        from posttrain.train.loss_fns import make_actor_loss_fn

        rl, plan, s = self.cfg.rl, self.plan, self.s
        columns = ["advantages"]
        if not plan.skip_old_logprobs:
            columns.append("old_logprobs")
        kl_in_loss = s.policy.reference is not None and plan.stage.kl_in_loss  # PPO: the KL is in the reward
        if kl_in_loss:
            columns.append("ref_logprobs")
        if self.weighted_update:
            columns.append("rollout_weights")
        loss_fn = make_actor_loss_fn(plan.actor_loss, kl_coef=self.kl_ctrl.value if kl_in_loss else 0.0)
        while not td.all_consumed("actor_update"):
            batch, _, _ = read_batch(td, "actor_update", columns, plan.reads["actor_update_dispatch_size"],
                                     pad_token_id=s.policy.pad_token_id, device=s.device)
            steps = s.policy.actor.update(batch, loss_fn, mini_batch_size=plan.mini_batch_rows, epochs=rl.epochs,
                                          shuffle=rl.shuffle_mini_batch, seed=self.cfg.actor.seed + iteration)
            for step in steps:
                check_finite_step(step, iteration)
                acc.update(step)
