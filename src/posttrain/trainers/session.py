"""One training run's components, built once from the config: models, engines, data, rewards,
logs, checkpoints and held-out evaluation. The loops in this package drive a :class:`Session`."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from posttrain.cluster.launch import wants_ray
from posttrain.config.run import RunConfig
from posttrain.config.validate import Layout
from posttrain.device import resolve_device
from posttrain.trainers import setup

log = logging.getLogger(__name__)


class Session:
    def __init__(self, cfg: RunConfig, layout: Layout, *, uses_reference: bool, run_dir: Path):
        import torch

        from posttrain.metrics.sinks import MetricsLogger
        from posttrain.reward.rule_reward import RuleReward
        from posttrain.rollout.base import SamplingParams

        a, rl = cfg.actor, cfg.rl
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        setup.seed_everything(a.seed)
        if a.npu_deterministic:
            torch.use_deterministic_algorithms(True)
        self.device = resolve_device(rl.device)
        self.train_dtype, self.rollout_dtype = setup.precision(cfg, self.device)
        if cfg.ignored_keys:
            log.warning("Megatron-only keys accepted and ignored (no PyTorch equivalent): %s",
                        ", ".join(cfg.ignored_keys))

        # data first: a bad dataset fails before any model loads
        self.dataset = setup.build_prompt_dataset(a, rl.max_prompt_length)
        self.extra_parts: dict[str, Any] = {}  # more trained modules to checkpoint (PPO: "critic")
        self.cluster = None
        if wants_ray(cfg):  # the roles run as Ray actors (posttrain.cluster); same methods as below
            from posttrain.cluster import build_cluster

            self.cluster = build_cluster(cfg, layout, uses_reference=uses_reference, device=self.device,
                                         train_dtype=self.train_dtype, rollout_dtype=self.rollout_dtype)
            policy = self.cluster.policy
            self.device = "cpu"  # the driver's batches stay on CPU; the workers move them to their device
        else:
            policy = setup.build_policy(cfg, self.device, self.train_dtype, self.rollout_dtype, uses_reference)
        self.model, self.tokenizer = policy.model, policy.tokenizer  # model: None with Ray (weights in workers)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.actor, self.reference, self.rollout = policy.actor, policy.reference, policy.rollout
        self.stop_token_ids = policy.stop_token_ids

        state = policy.state  # resumed or fresh
        self.trainer_state: dict[str, Any] = state
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        self.initial_model = str(state["initial_model"])
        self.sampler = setup.build_sampler(len(self.dataset), a, state.get("sampler_state"))
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

    def actor_loss_fn(self, bundle, kl_coef: float):
        from posttrain.train.loss_fns import make_actor_loss_fn

        kwargs = bundle.actor_loss_kwargs(self.cfg.rl, self.cfg.generate.sampling_config.max_tokens)
        temperature = self.cfg.generate.sampling_config.temperature or 1.0
        return make_actor_loss_fn(temperature=temperature, kl_coef=kl_coef if self.reference is not None else 0.0,
                                  **kwargs)

    def after_iteration(self, iteration: int, extra_state: dict) -> None:
        self.consumed_samples += self.cfg.actor.global_batch_size
        interval = self.cfg.actor.save_interval
        if self.cfg.actor.save and interval and iteration % interval == 0:
            self.save(iteration, extra_state)
        every = self.cfg.rl.eval_interval
        if self.eval_data is not None and every and iteration % every == 0 and iteration != self.cfg.actor.train_iters:
            self.log_eval(iteration)

    def finish(self, extra_state: dict) -> None:
        try:
            if self.cfg.actor.save and self.iteration > 0:
                self.save(self.iteration, extra_state)
            if self.eval_data is not None:
                self.log_eval(self.iteration)
        finally:
            self.close()

    def close(self) -> None:
        self.rule_reward.close()
        self.logger.close()
        if self.cluster is not None:
            self.cluster.close()

    def save(self, iteration: int, extra_state: dict):
        from posttrain.checkpoint import save_checkpoint

        a = self.cfg.actor
        state = {"iteration": iteration, "consumed_samples": self.consumed_samples,
                 "initial_model": self.initial_model, **extra_state}
        if self.cluster is not None:  # rank 0 of the actor workers saves the full state
            return self.cluster.save(a.save, iteration, sampler_state=self.sampler.state_dict(), trainer_state=state,
                                     save_optim=not a.no_save_optim, save_rng=not a.no_save_rng)
        return save_checkpoint(a.save, iteration, self.model, self.actor.optimizer, self.actor.scheduler,
                               tokenizer=self.tokenizer, sampler_state=self.sampler.state_dict(),
                               trainer_state=state, save_optim=not a.no_save_optim, save_rng=not a.no_save_rng,
                               extra=self.extra_parts)

    # ---- held-out evaluation -------------------------------------------------------------------
    def _load_eval_data(self):
        rl = self.cfg.rl
        if not rl.eval_data_path:
            return None
        from posttrain.reward.decoding import decode_labels

        ds = setup.build_prompt_dataset(self.cfg.actor, rl.max_prompt_length, data_path=rl.eval_data_path)
        count = min(len(ds), rl.eval_limit or len(ds))
        items = [ds[i] for i in range(count)]
        prompts = [[int(t) for t in it["prompts"]] for it in items]
        labels = decode_labels(self.tokenizer, [[int(t) for t in it["labels"]] for it in items])
        return prompts, labels

    def log_eval(self, iteration: int) -> dict[str, float]:
        from posttrain.trainers.evaluate import evaluate, greedy

        prompts, labels = self.eval_data
        result = evaluate(self.rollout, self.tokenizer, prompts, labels, self.rule_reward,
                          sampling=greedy(self.sampling), stop_token_ids=self.stop_token_ids)
        metrics = {f"eval/{k}": v for k, v in result.items()}
        with (self.run_dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        log.info("eval at iteration %d: %s", iteration, metrics)
        self.logger.log(iteration, metrics)
        return metrics
