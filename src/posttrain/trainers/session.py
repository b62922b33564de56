"""One training run's shared machinery, built once from the config and its plan, for every loop:
seeding, the data, the policy (in this process or on Ray workers), the sampler, logs,
``config.json``, checkpoints on their schedule and, for on-policy runs, rewards and held-out
evaluation. The loops (:mod:`posttrain.trainers.onpolicy`, :mod:`posttrain.trainers.offline`)
drive a :class:`Session`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from posttrain.config.plan import Plan
from posttrain.config.run import RunConfig
from posttrain.roles.policy import Policy, build_policy, seed_everything

log = logging.getLogger(__name__)


class Session:
    def __init__(self, cfg: RunConfig, plan: Plan, run_dir: Path):
        import torch

        from posttrain.data.builders import build_offline_dataset, build_prompt_dataset

        a, rl = cfg.actor, cfg.rl
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.closed = False
        on_policy = plan.stage.on_policy
        run_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(a.seed)
        if a.npu_deterministic:
            torch.use_deterministic_algorithms(True)
        for warning in plan.warnings:
            log.warning("%s", warning)
        self.device = plan.device
        # data first: a bad dataset fails before any model loads
        self.dataset = (build_prompt_dataset(a, rl.max_prompt_length) if on_policy
                        else build_offline_dataset(a, plan.stage.name))
        self.extra_parts: dict[str, Any] = {}  # more trained modules to checkpoint (PPO: "critic")
        self.cluster = self.rule_reward = self.eval_data = self.logger = None
        try:
            self._build(cfg, plan, run_dir)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: RunConfig, plan: Plan, run_dir: Path) -> None:
        from posttrain.data.builders import build_sampler
        from posttrain.metrics.sinks import MetricsLogger

        a, rl, on_policy = cfg.actor, cfg.rl, plan.stage.on_policy
        if plan.use_ray:  # the roles run as Ray actors (posttrain.cluster); the same methods
            from posttrain.cluster import build_cluster

            self.cluster = build_cluster(cfg, plan)
            self.policy: Policy = self.cluster.policy
            self.device = "cpu"  # the driver's batches stay on CPU; the workers move them to their device
        else:
            self.policy = build_policy(cfg, plan, self.device, with_rollout=on_policy)
        state = self.policy.state  # resumed or fresh
        self.trainer_state: dict[str, Any] = state
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        self.initial_model = str(state["initial_model"])
        self.sampler = build_sampler(len(self.dataset), a, state.get("sampler_state"))
        if on_policy:
            from posttrain.reward.rule_reward import RuleReward
            from posttrain.rollout.base import SamplingParams

            self.sampling = SamplingParams.from_config(cfg.generate.sampling_config.model_dump())
            self.rule_reward = self.cluster.rule_reward if self.cluster else RuleReward.from_rl_config(rl)
            self.eval_data = self._load_eval_data()
        self.logger = MetricsLogger(run_dir, rl.use_tensorboard, rl.tensorboard_log_dir, rl.use_wandb,
                                    rl.wandb_project, rl.wandb_exp_name, rl.wandb_save_dir, a.train_iters,
                                    start_iteration=self.iteration)
        (run_dir / "config.json").write_text(json.dumps(cfg.raw, indent=2, default=str))
        if self.iteration == 0 and self.eval_data is not None:
            self.log_eval(0)

    # ---- per-iteration helpers -----------------------------------------------------------------
    def sampling_for(self, iteration: int):
        """Sampling parameters with a per-iteration seed, so runs (and resumed runs) repeat exactly."""
        base = self.sampling.seed if self.sampling.seed is not None else self.cfg.actor.seed
        return replace(self.sampling, seed=base + iteration)

    def after_iteration(self, iteration: int, metrics: dict[str, float], extra_state: dict | None = None) -> None:
        """Log ``metrics``, then save and evaluate on the config's schedule."""
        self.iteration = iteration
        self.logger.log(iteration, metrics)
        self.consumed_samples += self.cfg.actor.global_batch_size
        interval = self.cfg.actor.save_interval
        if self.cfg.actor.save and interval and iteration % interval == 0:
            self.save(iteration, extra_state or {})
        every = self.cfg.rl.eval_interval
        if self.eval_data is not None and every and iteration % every == 0 and iteration != self.cfg.actor.train_iters:
            self.log_eval(iteration)

    def finish(self, extra_state: dict | None = None) -> None:
        """The final save and evaluation; closes the session."""
        try:
            if self.cfg.actor.save and self.iteration > 0:
                self.save(self.iteration, extra_state or {})
            if self.eval_data is not None:
                self.log_eval(self.iteration)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the reward workers, the logs and the Ray workers (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        if self.rule_reward is not None:
            self.rule_reward.close()
        if self.logger is not None:
            self.logger.close()
        if self.cluster is not None:
            self.cluster.close()

    def save(self, iteration: int, extra_state: dict):
        """The one checkpoint save of a run (on Ray, rank 0 of the actor workers writes it)."""
        from posttrain.checkpoint import save_checkpoint

        a, p = self.cfg.actor, self.policy
        state = {"iteration": iteration, "consumed_samples": self.consumed_samples,
                 "initial_model": self.initial_model, **extra_state}
        if self.cluster is not None:
            return self.cluster.save(a.save, iteration, sampler_state=self.sampler.state_dict(), trainer_state=state,
                                     save_optim=not a.no_save_optim, save_rng=not a.no_save_rng)
        return save_checkpoint(a.save, iteration, p.model, p.actor.optimizer, p.actor.scheduler,
                               tokenizer=p.tokenizer, sampler_state=self.sampler.state_dict(),
                               trainer_state=state, save_optim=not a.no_save_optim, save_rng=not a.no_save_rng,
                               extra=self.extra_parts)

    # ---- held-out evaluation -------------------------------------------------------------------
    def _load_eval_data(self):
        rl = self.cfg.rl
        if not rl.eval_data_path:
            return None
        from posttrain.data.builders import build_prompt_dataset
        from posttrain.reward.decoding import decode_labels

        ds = build_prompt_dataset(self.cfg.actor, rl.max_prompt_length, data_path=rl.eval_data_path)
        count = min(len(ds), rl.eval_limit or len(ds))
        items = [ds[i] for i in range(count)]
        prompts = [[int(t) for t in it["prompts"]] for it in items]
        labels = decode_labels(self.policy.tokenizer, [[int(t) for t in it["labels"]] for it in items])
        return prompts, labels

    def log_eval(self, iteration: int) -> dict[str, float]:
        from posttrain.trainers.evaluate import evaluate, greedy

        prompts, labels = self.eval_data
        result = evaluate(self.policy.rollout, self.policy.tokenizer, prompts, labels, self.rule_reward,
                          sampling=greedy(self.sampling), stop_token_ids=self.policy.stop_token_ids)
        metrics = {f"eval/{k}": v for k, v in result.items()}
        with (self.run_dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        log.info("eval at iteration %d: %s", iteration, metrics)
        self.logger.log(iteration, metrics)
        return metrics
