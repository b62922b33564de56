"""One training run's components, built once from the config: models, engines, data, rewards,
logs, checkpoints and held-out evaluation. The loops in this package drive a :class:`Session`."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

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
        from posttrain.rollout.base import SamplingParams, get_engine

        a, rl, gen = cfg.actor, cfg.rl, cfg.generate
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
        model, self.tokenizer, source = setup.build_actor_model(cfg, self.device)
        self.model = model
        self.pad_token_id = self.tokenizer.pad_token_id
        steps_per_iter = (a.global_batch_size // rl.mini_batch_size) * rl.epochs
        self.actor = setup.build_train_engine(model, a, a.train_iters * steps_per_iter, self.train_dtype)

        # resume or start
        state = setup.resume(source, model, self.actor, a)
        self.trainer_state: dict[str, Any] = state
        self.extra_parts: dict[str, Any] = {}  # more trained modules to checkpoint (PPO: "critic")
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        self.initial_model = str(state["initial_model"])
        self.sampler = setup.build_sampler(len(self.dataset), a, state.get("sampler_state"))

        self.reference = None
        if uses_reference:
            ref_path = (rl.integrated_mode_config or {}).get("ref_model_load_path")
            if ref_path is None and self.iteration > 0:
                ref_path = self.initial_model  # a resumed actor is not the reference
            ref_model = setup.build_frozen_copy(model, ref_path, self.device)
            from posttrain.train.engine import TrainEngine

            self.reference = TrainEngine(ref_model, micro_batch_size=a.micro_batch_size, dtype=self.train_dtype)

        from posttrain.train.dynamic_batch import apply_rl_config

        apply_rl_config(self.actor, rl, "actor")  # use_remove_padding, use_dynamic_bsz budgets
        if self.reference is not None:
            apply_rl_config(self.reference, rl, "ref")

        self.stop_token_ids = setup.stop_token_ids(self.tokenizer, a.prompt_type, a.prompt_type_path)
        # The seed's default max_num_seqs (1) is a vLLM setting; one row per batch would make the
        # native engine needlessly slow, so an unset value means 256 here.
        max_num_seqs = gen.max_num_seqs if setup.explicitly_set(cfg, ("generate_config", "max_num_seqs")) else 256
        self.rollout = get_engine(rl.rollout_engine, model=model, pad_token_id=self.pad_token_id,
                                  eos_token_ids=self.stop_token_ids, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=gen.max_num_batched_tokens, dtype=self.rollout_dtype)
        self.sampling = SamplingParams.from_config(gen.sampling_config.model_dump())
        self.rule_reward = RuleReward.from_rl_config(rl)
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

    def save(self, iteration: int, extra_state: dict):
        from posttrain.checkpoint import save_checkpoint

        a = self.cfg.actor
        state = {"iteration": iteration, "consumed_samples": self.consumed_samples,
                 "initial_model": self.initial_model, **extra_state}
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
