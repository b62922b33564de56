"""One training run's shared machinery, built once from its plan, for every loop: seeding, the
data, the directories and the starting checkpoint (checked first, :mod:`posttrain.rundir`), the
policy (in this process or on Ray workers), the sampler, logs, ``config.json``, checkpoints on
their schedule and, for on-policy runs, rewards and held-out evaluation. The loops
(:mod:`posttrain.loops.onpolicy`, :mod:`posttrain.loops.offline`) drive a :class:`Session`.

The run's process-wide settings are chosen once here and undone at the end: torch's threads and
the fp32 linear kernel on a CPU (:mod:`posttrain.models.cpu_linear`), both measured when the run
starts (or taken from the checkpoint it resumes, so a resume computes as the run it continues)
and recorded in the run's ``run.json`` and in every checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from posttrain.config.files import run_dirs
from posttrain.config.plan import Plan
from posttrain.data.builders import build_offline_dataset, build_prompt_dataset, build_sampler
from posttrain.device import device_type
from posttrain.envs.dataset import build_env_dataset
from posttrain.host_memory import keep_freed_memory
from posttrain.metrics.sinks import MetricsLogger, append_line, cut_jsonl, write_text_atomic
from posttrain.models import cpu_linear
from posttrain.models.packed_linear import rollout_packed_weights, use_rollout_packed
from posttrain.roles.policy import Policy, build_policy, seed_everything
from posttrain.rundir import DirLock, Start, checked_start, claim_run_dirs
from posttrain.training.engine import NaNLossError
from posttrain.metrics.dumps import DumpRecorder
from posttrain.metrics.profiler import RunProfiler

log = logging.getLogger(__name__)


def check_finite_step(step: dict[str, float], iteration: int) -> None:
    """A non-finite loss, gradient norm, learning rate or other update metric stops the run with
    :class:`~posttrain.training.engine.NaNLossError` before the iteration is logged or saved: the
    weights it produced are not trustworthy, and the last checkpoint stays the latest."""
    bad = {k: v for k, v in step.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise NaNLossError(f"non-finite training metric at iteration {iteration}: {shown}; the run stops before "
                           f"saving (the last checkpoint is kept). Lower the learning rate, or check lr / "
                           f"weight_decay for inf or nan")


class Session:
    def __init__(self, plan: Plan, *, load_previous_on_corruption: bool = False):
        self.plan, self.run_dir = plan, Path(plan.schedule.run_dir)
        self.profiler = RunProfiler(plan.profiler, plan.device)  # profiler_config.integrated
        self.dumps = DumpRecorder(plan.dumps)  # msprobe_config
        self.closed = False
        self.cluster = self.critic = self.rule_reward = self.reward_model = self.eval_data = self.logger = None
        self.judge = None  # rl_config.judge_path (posttrain.roles.judge)
        self.queue = None  # rl_config.data_strategy: tq: TransferQueue (posttrain.cluster.transfer_queue)
        self.locks: list[DirLock] = []
        self.settings = contextlib.ExitStack()  # the process-wide settings of the run, undone by close()
        self.extra_parts: dict[str, Any] = {}  # more trained modules to checkpoint (PPO: "critic")
        self.extra_files: dict[str, Any] = {}  # more objects to checkpoint, by file name (async: "in_flight.pt")
        try:
            seed_everything(plan.policy.seed)
            if plan.policy.deterministic:
                torch.use_deterministic_algorithms(True)
            for warning in plan.warnings:
                log.warning("%s", warning)
            self.device = plan.device
            # data first: a bad dataset fails before any model loads or any directory is created
            self.dataset = self._dataset()
            # then the directories and the checkpoint to start from, before any model is built:
            # a run that cannot write its results, or would load a corrupt file, stops here
            self.locks = claim_run_dirs(run_dirs(plan))
            self.plan = plan = self._with_built_tokenizer(plan)
            p = plan.policy
            start = checked_start(p.load or p.tokenizer, p.checkpoint, megatron=plan.parallel.backend == "megatron",
                                  load_previous_on_corruption=load_previous_on_corruption)
            self._build(start)
        except BaseException:
            self.close(refused=True)
            raise

    def _with_built_tokenizer(self, plan: Plan) -> Plan:
        """``tokenizer_type: GPT2BPETokenizer``: the tokenizer built from its files once, into
        ``<run dir>/tokenizer``, which every process and checkpoint of the run then reads."""
        files = plan.policy.tokenizer_files
        if files is None:
            return plan
        from posttrain.data.tokenizer_files import write_tokenizer_dir

        path = write_tokenizer_dir(files, self.run_dir / "tokenizer", "megatron_training.")
        return replace(plan, policy=replace(plan.policy, tokenizer=str(path)))

    def _dataset(self):
        d, stage = self.plan.data, self.plan.stage
        if stage.on_policy and d.env is not None:  # rl_config.env_config: the environment's tasks (posttrain.envs)
            return build_env_dataset(d.env, self.plan.policy, d.max_prompt_length)
        if stage.on_policy:
            mm = self.plan.multimodal
            return build_prompt_dataset(d.data_path, d.max_prompt_length, additional_keys=d.additional_keys,
                                        split=d.split, images_per_prompt=mm.images_per_prompt if mm else None,
                                        videos_per_prompt=mm.videos_per_prompt if mm else 0)
        mm = self.plan.multimodal  # stage sft with images (docs/multimodal.md)
        return build_offline_dataset(d.data_path, stage.name, seq_length=d.seq_length, split=d.split,
                                     unpaired=self.plan.dpo is not None and self.plan.dpo.unpaired,
                                     images_per_sample=mm.images_per_prompt if mm else None,
                                     videos_per_sample=mm.videos_per_prompt if mm else 0)

    def _build(self, start: Start) -> None:
        plan, on_policy = self.plan, self.plan.stage.on_policy
        self.start_source = start.source  # what the policy loads (a replica of it too)
        self.num_threads = self._set_threads(plan.schedule.num_threads, start.saved_state.get("num_threads"))
        self.cpu_linear = self._linear_kernel(start.saved_state.get("cpu_linear"))
        # the native rollout on prepacked weights or not: decided once for the run (models.packed_linear)
        self.rollout_packed = rollout_packed_weights(plan, self.cpu_linear, start.saved_state.get("rollout_packed"))
        self.settings.enter_context(use_rollout_packed(self.rollout_packed))
        self.keeps_freed_memory = not plan.use_ray and self.settings.enter_context(
            keep_freed_memory(device_type(plan.device)))
        if self.keeps_freed_memory:
            log.info("freed host memory stays in the process for reuse (posttrain.host_memory; "
                     "POSTTRAIN_MALLOC=default keeps glibc's behaviour)")
        if plan.use_ray:  # the roles run as Ray actors (posttrain.cluster); the same methods
            from posttrain.cluster import build_cluster

            self.cluster = build_cluster(plan, self.worker_start())
            self.policy: Policy = self.cluster.policy
            self.device = "cpu"  # the driver's batches stay on CPU; the workers move them to their device
        else:
            self.policy = build_policy(plan, self.device, source=start.source, with_rollout=on_policy)
        state = self.policy.state  # resumed or fresh
        self.trainer_state: dict[str, Any] = state
        if plan.uses_critic:  # PPO: in this process, or colocated in the Ray actor workers
            self._build_critic(state)
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        self.initial_model = str(state["initial_model"])
        d = plan.data
        self.sampler = build_sampler(len(self.dataset), plan.prompts_per_iteration, d.seed, no_shuffle=d.no_shuffle,
                                     full_shuffle=d.full_shuffle, train_iters=plan.train_iters,
                                     state=state.get("sampler_state"))
        if on_policy:
            self.sampling = plan.rollout.sampling
            if plan.rule_reward is not None:  # the training scores; the held-out accuracy
                self.rule_reward = self.cluster.rule_reward if self.cluster else self._rule_reward()
            if plan.reward_model is not None:  # in this process, or colocated in the Ray actor workers
                self.reward_model = self.cluster.reward_model if self.cluster else self._reward_scorer()
            if plan.judge is not None:  # in this process (Ray placements are refused: posttrain.config.compat)
                from posttrain.roles.judge import build_judge

                self.judge = build_judge(plan.judge, self.policy, self.device)
            self.eval_data = self._load_eval_data()
            if plan.data_strategy == "tq":  # after the cluster: on Ray, it joins the cluster's Ray
                from posttrain.cluster.transfer_queue import TransferQueueStore

                self.queue = TransferQueueStore.start(plan)
        self._open_logs()
        self.start_eval: dict[str, float] = {}  # the held-out evaluation of the weights the run starts from
        if self.eval_data is not None and (self.iteration == 0 or plan.schedule.skip_train):
            self.start_eval = self.log_eval(self.iteration)

    def _build_critic(self, state: dict) -> None:
        if self.cluster is not None:
            self.critic = self.cluster.critic
            return
        from posttrain.roles.critic import Critic

        self.critic = Critic(self.plan, state, self.device)
        if self.critic.save_dir is None:  # saved inside the actor's checkpoints
            self.extra_parts["critic"] = self.critic.part

    def _open_logs(self) -> None:
        plan, logs = self.plan, self.plan.logging
        self.logger = MetricsLogger(self.run_dir, logs.use_tensorboard, logs.tensorboard_dir, logs.use_wandb,
                                    logs.wandb_project, logs.wandb_exp_name, logs.wandb_save_dir, plan.train_iters,
                                    start_iteration=self.iteration, resume_iteration=self.iteration,
                                    config=json.loads(plan.config_json), trackio_project=logs.trackio_project,
                                    mlflow_uri=logs.mlflow_uri, mlflow_experiment=logs.mlflow_experiment,
                                    swanlab=logs.swanlab)
        cut_jsonl(self.run_dir / "eval.jsonl", self.iteration)  # rows after the iteration resumed from are stale
        write_text_atomic(self.run_dir / "config.json", plan.config_json)
        self.dumps.write_config(plan.config_json)  # msprobe_config.configurations_dump
        info = {"device": plan.device, "train_dtype": plan.train_dtype, "rollout_dtype": plan.rollout_dtype,
                "num_threads": self.num_threads, "cpu_linear": self.cpu_linear,
                "compile_regions": plan.actor_engine.compile_regions,
                "rollout_packed_weights": self.rollout_packed, "keep_freed_memory": self.keeps_freed_memory}
        write_text_atomic(self.run_dir / "run.json", json.dumps(info, indent=2) + "\n")

    def _rule_reward(self):
        if self.plan.data.env is not None:  # the environment's own reward functions score its tasks' responses
            from posttrain.envs.reward import EnvReward

            return EnvReward(self.dataset.env)
        from posttrain.reward.rule_reward import RuleReward

        return RuleReward.from_options(self.plan.rule_reward)

    def _reward_scorer(self):
        from posttrain.roles.reward_model import build_reward_scorer

        return build_reward_scorer(self.plan.reward_model, self.policy.tokenizer, self.device)

    # ---- the run's process-wide settings ----------------------------------------------------------
    def _set_threads(self, configured: int | None, stored: int | None) -> int | None:
        """Fix this process's torch threads for the run (in process; Ray workers set theirs), and
        restore torch's count when the run ends."""
        from posttrain.device import cpu_threads

        if self.plan.use_ray:
            return None
        before = torch.get_num_threads()
        threads, why = cpu_threads(configured, stored, before)
        torch.set_num_threads(threads)
        self.settings.callback(torch.set_num_threads, before)
        log.info("torch threads: %d (%s)", threads, why)
        return threads

    def worker_start(self) -> dict:
        """What a Ray worker of the run starts from: the policy's source and the run's kernel choices
        (installed there by :func:`posttrain.models.packed_linear.install_run_kernels`)."""
        return {"source": self.start_source, "cpu_linear": self.cpu_linear, "rollout_packed": self.rollout_packed}

    def _linear_kernel(self, stored: str | None) -> str:
        """The fp32 linear kernel of the run (:func:`posttrain.models.cpu_linear.resolve_cpu_linear`,
        timed at the run's thread count, or the checkpoint's), installed in this process for the run's
        duration (Ray workers install the one the driver chose)."""
        plan = self.plan
        kind = cpu_linear.resolve_cpu_linear(plan.device, stored=stored)
        if not plan.use_ray:
            self.settings.enter_context(cpu_linear.use_cpu_linear(kind))
        log.info("precision on %s: %s training, %s rollout, frozen weights (reference, LoRA base) stored in %s "
                 "(bf16 where the device computes it natively, unless the config sets bf16: false / "
                 "generate_config.dtype: float32); fp32 linear layers by %s",
                 plan.device, plan.train_dtype, plan.rollout_dtype, plan.frozen_dtype,
                 "oneDNN (faster than the BLAS on this CPU)" if kind == "onednn" else "PyTorch's BLAS")
        return kind

    # ---- per-iteration helpers -----------------------------------------------------------------
    def sampling_for(self, iteration: int):
        """Sampling parameters with a per-iteration seed, so runs (and resumed runs) repeat exactly."""
        base = self.sampling.seed if self.sampling.seed is not None else self.plan.policy.seed
        return replace(self.sampling, seed=base + iteration)

    def saves_or_evaluates(self, iteration: int) -> bool:
        """Whether :meth:`after_iteration` saves a checkpoint or runs the held-out evaluation."""
        return self.plan.schedule.saves(iteration) or self._evaluates(iteration)

    def _evaluates(self, iteration: int) -> bool:
        return self.eval_data is not None and self.plan.schedule.evaluates(iteration, self.plan.train_iters)

    def after_iteration(self, iteration: int, metrics: dict[str, float], extra_state: dict | None = None) -> None:
        """Log ``metrics``, then save and evaluate on the config's schedule."""
        self.iteration = iteration
        self._record_region_choices()
        self.logger.log(iteration, metrics)
        self.last_metrics = dict(metrics)  # the model card of a checkpoint saved now
        self.consumed_samples += self.plan.prompts_per_iteration
        if self.plan.schedule.saves(iteration):
            self.save(iteration, extra_state or {})
        if self._evaluates(iteration):
            self.log_eval(iteration)

    def _record_region_choices(self) -> None:
        """``compile_regions: auto``: the actor's choices (made at its first update) into ``run.json``, once."""
        choices = getattr(getattr(self.policy, "actor", None), "region_choices", None)
        if not choices or getattr(self, "_regions_recorded", False):
            return
        path = self.run_dir / "run.json"
        info = json.loads(path.read_text())
        info["compiled_regions"] = {region: choice.to_json() for region, choice in choices.items()}
        write_text_atomic(path, json.dumps(info, indent=2) + "\n")
        self._regions_recorded = True

    def finish(self, extra_state: dict | None = None) -> None:
        """The final save and evaluation; closes the session."""
        try:
            if self.plan.schedule.save and self.iteration > 0:
                self.save(self.iteration, extra_state or {})
            if self.eval_data is not None:
                self.log_eval(self.iteration)
        finally:
            self.close()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Around one phase of the loop (a :class:`~posttrain.metrics.timers.Timers` ``around``): the
        profiler's range and the accuracy dumps of its models (:mod:`posttrain.loops.dump_points`)."""
        from posttrain.loops.dump_points import dumped_phase

        with self.profiler.phase(name), dumped_phase(self, self.dumps, name):
            yield

    def close(self, refused: bool = False) -> None:
        """Stop the reward workers, the logs and the Ray workers, undo the run's process-wide
        settings and release the directories (once; later calls do nothing). ``refused``: the run
        stopped before its first iteration, so the lock files and the still-empty directories it
        created are removed (:meth:`~posttrain.rundir.DirLock.abandon`)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.rule_reward is not None:
                self.rule_reward.close()
            if self.logger is not None:
                self.logger.close()
            if self.queue is not None:  # before the cluster, which may shut Ray down
                self.queue.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.settings.close()
            for lock in reversed(self.locks):
                lock.abandon() if refused else lock.release()
            self.locks = []

    def save(self, iteration: int, extra_state: dict):
        """The one checkpoint save of a run (on Ray, rank 0 of the actor workers writes it)."""
        from posttrain.checkpoint import prune_checkpoints, save_checkpoint

        s, p = self.plan.schedule, self.policy
        self._check_finite_weights(iteration)
        state = {"iteration": iteration, "consumed_samples": self.consumed_samples,
                 "initial_model": self.initial_model, "num_threads": self.num_threads,
                 "cpu_linear": self.cpu_linear, "rollout_packed": self.rollout_packed, **extra_state}
        if self.cluster is not None:
            path = self.cluster.save(s.save, iteration, sampler_state=self.sampler.state_dict(), trainer_state=state,
                                     save_optim=s.save_optim, save_rng=s.save_rng, files=self.extra_files)
        else:
            from posttrain.training.offload import on_device

            with on_device(p.actor, getattr(self.critic, "engine", None)):  # an offloaded state is saved too
                path = save_checkpoint(s.save, iteration, p.model, p.actor.optimizer, p.actor.scheduler,
                                       tokenizer=p.processor or p.tokenizer, sampler_state=self.sampler.state_dict(),
                                       trainer_state=state, save_optim=s.save_optim, save_rng=s.save_rng,
                                       extra=self.extra_parts, files=self.extra_files, adapter_only=s.adapter_only)
        self._write_card(path, iteration)
        if self.critic is not None:  # PPO: the critic's own checkpoint (critic_config.save), if it has one
            critic_path = self.critic.save(iteration, tokenizer=p.tokenizer, trainer_state=state)
            if critic_path is not None:
                self._write_card(critic_path, iteration, role="critic")
            if critic_path is not None and s.keep_last:
                prune_checkpoints(critic_path.parent, s.keep_last)
        if s.keep_last:
            prune_checkpoints(s.save, s.keep_last)
        return path

    def _write_card(self, path, iteration: int, role: str = "policy") -> None:
        """A model card (README.md) in a checkpoint that Hugging Face can load (not a Megatron one)."""
        from posttrain.checkpoint.card import CardInfo, write_model_card

        path = Path(path)
        adapter = (path / "adapter_config.json").is_file()
        if not adapter and not (path / "config.json").is_file():
            return
        write_model_card(path, CardInfo(algorithm=self.plan.stage.name, base_model=self.initial_model,
                                        data=self.plan.data.data_path or "", config_json=self.plan.config_json,
                                        iteration=iteration, metrics=getattr(self, "last_metrics", {}),
                                        adapter=adapter, role=role))

    def _check_finite_weights(self, iteration: int) -> None:
        """Refuse to save weights holding NaN/inf (the loops already stop on a non-finite loss,
        gradient norm or metric; this is the last guard before such a model becomes ``latest``)."""
        models = [("actor", self.policy.model)] + [(n, part.model) for n, part in self.extra_parts.items()]
        for role, model in models:
            if model is None:  # on Ray the weights live in the workers
                continue
            for name, param in model.named_parameters():
                if param.is_floating_point() and not bool(torch.isfinite(param).all()):
                    raise NaNLossError(f"the {role} weight {name} holds NaN/inf at iteration {iteration}; the "
                                       f"checkpoint was not saved (the previous one is kept). Lower the learning "
                                       f"rate, or check lr / weight_decay for inf or nan")

    # ---- held-out evaluation -------------------------------------------------------------------
    def _load_eval_data(self):
        d = self.plan.data
        if not d.eval_data_path:
            return None
        from posttrain.reward.decoding import decode_labels

        ds = build_prompt_dataset(d.eval_data_path, d.max_prompt_length, additional_keys=d.additional_keys,
                                  split=d.split, key="rl_config.eval_data_path")
        count = min(len(ds), d.eval_limit or len(ds))
        items = [ds[i] for i in range(count)]
        prompts = [[int(t) for t in it["prompts"]] for it in items]
        labels = decode_labels(self.policy.tokenizer, [[int(t) for t in it["labels"]] for it in items])
        return prompts, labels

    def log_eval(self, iteration: int) -> dict[str, float]:
        from posttrain.loops.evaluate import evaluate, greedy

        prompts, labels = self.eval_data
        result = evaluate(self.policy.rollout, self.policy.tokenizer, prompts, labels, self.rule_reward,
                          sampling=greedy(self.sampling), stop_token_ids=self.policy.stop_token_ids)
        metrics = {f"eval/{k}": v for k, v in result.items()}
        append_line(self.run_dir / "eval.jsonl", json.dumps({"iteration": iteration, **metrics}) + "\n",
                    f"the evaluation of iteration {iteration}")
        log.info("eval at iteration %d: %s", iteration, metrics)
        self.logger.log(iteration, metrics)
        return metrics
