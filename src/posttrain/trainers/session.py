"""One training run's shared machinery, built once from the config and its plan, for every loop:
seeding, the data, the policy (in this process or on Ray workers), the sampler, logs,
``config.json``, checkpoints on their schedule and, for on-policy runs, rewards and held-out
evaluation. The loops (:mod:`posttrain.trainers.onpolicy`, :mod:`posttrain.trainers.offline`)
drive a :class:`Session`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from posttrain.config.plan import Plan
from posttrain.config.run import RunConfig
from posttrain.errors import CheckpointError, ConfigError
from posttrain.roles.policy import Policy, build_policy, seed_everything

log = logging.getLogger(__name__)

LOCK_NAME = ".posttrain.lock"
METRICS_FILES = ("metrics.jsonl", "eval.jsonl")


# ---- the run's directories: checked, owned and locked before any work --------------------------
class DirLock:
    """An exclusive ``fcntl.flock`` on ``<directory>/.posttrain.lock``, held for a run's lifetime,
    so two runs never write the same save or output directory. The kernel drops the lock when the
    process dies, so a crashed run leaves no stale lock (the file itself stays, unlocked)."""

    def __init__(self, directory: Path, what: str):
        import fcntl

        self.path = directory / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except OSError as err:
            raise ConfigError(f"{what} {directory}: cannot create the lock file {self.path} ({err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            by = f" (process {holder})" if holder.isdigit() else ""
            raise ConfigError(f"{what} {directory} is in use by another run{by}: it holds the lock {self.path}. "
                              f"Wait for that run to end, or give this run another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        import fcntl

        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def writable_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and check that a file can be created in it; ConfigError
    naming ``what`` (the config key) otherwise. Run at start-up, before any iteration."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what} {directory} is an existing file, not a directory; give a directory path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{what} {directory}: cannot create the directory ({err})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".posttrain-write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{what} {directory} is not writable ({err}); fix its permissions or choose "
                          f"another directory") from None


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def resumes_from(role, save: str | Path) -> bool:
    """Whether ``role`` (actor_config, critic_config) continues the checkpoints in ``save``: its
    ``load`` is that directory (or one of its ``iter_*``) and ``finetune`` is off."""
    if not role.load or role.finetune:
        return False
    return _same_dir(role.load, save) or _same_dir(Path(role.load).parent, save)


def resumes_in_place(cfg: RunConfig) -> bool:
    """Whether this run continues the checkpoints in its own ``save`` directory."""
    return bool(cfg.actor.save) and resumes_from(cfg.actor, cfg.actor.save)


def _checkpoints_in(save: Path) -> list[str]:
    from posttrain.checkpoint import TRACKER

    names = [TRACKER] if os.path.lexists(save / TRACKER) else []
    return names + sorted(p.name for p in save.glob("iter_*"))


def _why_not_resumed(cfg: RunConfig) -> str:
    a = cfg.actor
    if not a.load:
        return "actor_config.load is not set"
    if a.finetune:
        return "actor_config.finetune is true: it would start again at iteration 0"
    return f"actor_config.load is {a.load}"


def claim_run_dirs(cfg: RunConfig, run_dir: Path, what_run_dir: str) -> list[DirLock]:
    """Check and lock the run's directories before any work, and refuse to write into a directory
    that holds another run's checkpoints or metrics (a run only continues its own, when it resumes
    from its save directory). Returns the locks to release at the end of the run."""
    a, rl = cfg.actor, cfg.rl
    writable_dir(run_dir, what_run_dir)
    if rl.use_tensorboard and rl.tensorboard_log_dir:
        writable_dir(Path(rl.tensorboard_log_dir), "rl_config.tensorboard_log_dir")
    if rl.use_wandb and rl.wandb_save_dir:
        writable_dir(Path(rl.wandb_save_dir), "rl_config.wandb_save_dir")
    save = Path(a.save) if a.save else None
    if save is not None:
        writable_dir(save, "actor_config.save")
    from posttrain.roles.critic import critic_save_dir

    critic_save = critic_save_dir(cfg) if cfg.critic is not None else None
    if critic_save is not None:
        writable_dir(critic_save, "critic_config.save")
    locks: list[DirLock] = []
    try:
        locks.append(DirLock(run_dir, what_run_dir))
        if save is not None and not _same_dir(save, run_dir):
            locks.append(DirLock(save, "actor_config.save"))
        if critic_save is not None and not _same_dir(critic_save, run_dir):
            locks.append(DirLock(critic_save, "critic_config.save"))
            _refuse_foreign_checkpoints(critic_save, cfg.critic, "critic_config")
        in_place = resumes_in_place(cfg) and bool(_checkpoints_in(save))
        if save is not None and not in_place:
            found = _checkpoints_in(save)
            if found:
                shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
                raise ConfigError(
                    f"actor_config.save {save} already holds checkpoints ({shown}), and this run would not resume "
                    f"from them ({_why_not_resumed(cfg)}); it refuses to overwrite them. Give a new save directory "
                    f"or remove that one; to continue those checkpoints set actor_config.load={save} and "
                    f"actor_config.finetune=false")
        if not in_place:
            found = [n for n in METRICS_FILES if os.path.lexists(run_dir / n)]
            if found:
                raise ConfigError(
                    f"{what_run_dir} {run_dir} already holds the metrics of an earlier run ({', '.join(found)}); "
                    f"this run would mix its rows with them. Give another output directory or remove those "
                    f"files (a run that resumes from its own save directory continues them)")
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _refuse_foreign_checkpoints(save: Path, role, section: str) -> None:
    """``save`` may hold checkpoints only when this role resumes from them (``load`` is ``save``
    or one of its ``iter_*``, ``finetune`` off)."""
    found = _checkpoints_in(save)
    if found and not resumes_from(role, save):
        raise ConfigError(f"{section}.save {save} already holds checkpoints ({', '.join(found[:4])}), and this run "
                          f"would not resume from them; give a new save directory, or set {section}.load={save} "
                          f"and {section}.finetune=false to continue them")


def checked_start(cfg: RunConfig, load_previous_on_corruption: bool = False, *, megatron: bool = False) -> RunConfig:
    """Read every file the run will load from ``actor_config.load`` before any model is built: a
    corrupt checkpoint is a :class:`CheckpointError` naming the file and the previous complete
    checkpoint. With ``load_previous_on_corruption`` the run resumes from that previous checkpoint
    instead (a warning names both); the returned config then loads it. ``megatron``: the Megatron
    backend's workers read a Megatron checkpoint shard by shard, so here its shards are only
    checked to be complete (the HF backend converts it once, when it is resolved)."""
    from posttrain.checkpoint import (check_model_files, earlier_checkpoints, list_checkpoints, resolve_checkpoint,
                                      verify_checkpoint)

    a = cfg.actor
    source = a.load or a.tokenizer_name_or_path  # where the policy's weights come from (model_source)
    if not source or not Path(source).is_dir():
        return cfg  # a missing path is reported by the policy's model_source()
    if megatron:
        from posttrain.models.mcore import layout
        from posttrain.models.mcore.convert import McoreCheckpoint

        if layout.is_mcore_checkpoint(source):
            it_dir = layout.iteration_dir(Path(source))
            if layout.is_dist_checkpoint(it_dir):  # torch_dist: its metadata and common entries readable
                from torch.distributed.checkpoint import FileSystemReader

                for part in [it_dir] + [d for d in it_dir.iterdir() if layout.is_dist_checkpoint(d)]:
                    layout.load_common(part)
                    try:
                        FileSystemReader(str(part)).read_metadata()
                    except Exception as err:  # noqa: BLE001 - name the file whatever torch raises
                        raise CheckpointError(f"{part / layout.DIST_METADATA}: not readable ({err})") from None
                return cfg
            ckpt = McoreCheckpoint(source)  # every rank's shard present, from one save
            for rank_file in sorted(ckpt.dir.glob(f"**/{layout.RANK_FILE}")):  # the critic's too
                layout.load_rank_file(rank_file)  # readable: a CheckpointError names the file
            return cfg
    flags = dict(optim=not (a.no_load_optim or a.finetune), rng=not (a.no_load_rng or a.finetune))
    try:
        path, full = resolve_checkpoint(source)
    except CheckpointError as err:  # the tracker names a missing or incomplete iter_*, or no model there
        if not a.load:
            return cfg  # a tokenizer-only directory: reported when the model is built
        bad, error, candidates = Path(source), err, [p for _, p in reversed(list_checkpoints(source))]
    else:
        try:
            verify_checkpoint(path, **flags) if full else check_model_files(path)
            return cfg
        except CheckpointError as err:
            if not full:
                raise
            bad, error, candidates = path, err, earlier_checkpoints(path)
    if not candidates:
        raise error
    if not load_previous_on_corruption:
        raise CheckpointError(f"{error}. The previous complete checkpoint {candidates[0]} exists: rerun with "
                              f"`posttrain train --load-previous-on-corruption ...` to resume from it (or set "
                              f"actor_config.load={candidates[0]})") from None
    for previous in candidates:
        try:
            verify_checkpoint(previous, **flags)
        except CheckpointError as err2:
            log.warning("the earlier checkpoint %s is not usable either: %s", previous, err2)
            continue
        log.warning("%s cannot be loaded (%s); resuming from the previous complete checkpoint %s instead "
                    "(--load-previous-on-corruption)", bad, error, previous)
        return dataclasses.replace(cfg, actor=a.model_copy(update={"load": str(previous)}))
    raise CheckpointError(f"{error}. No earlier checkpoint next to it is complete and readable") from None


def check_finite_step(step: dict[str, float], iteration: int) -> None:
    """A non-finite loss, gradient norm, learning rate or other update metric stops the run with
    :class:`~posttrain.train.engine.NaNLossError` before the iteration is logged or saved: the
    weights it produced are not trustworthy, and the last checkpoint stays the latest."""
    from posttrain.train.engine import NaNLossError

    bad = {k: v for k, v in step.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise NaNLossError(f"non-finite training metric at iteration {iteration}: {shown}; the run stops before "
                           f"saving (the last checkpoint is kept). Lower the learning rate, or check lr / "
                           f"weight_decay for inf or nan")


class Session:
    def __init__(self, cfg: RunConfig, plan: Plan, run_dir: Path, *, load_previous_on_corruption: bool = False):
        import torch

        from posttrain.data.builders import build_offline_dataset, build_prompt_dataset

        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.closed = False
        self.cluster = self.critic = self.rule_reward = self.reward_model = self.eval_data = self.logger = None
        self.locks: list[DirLock] = []
        self.extra_parts: dict[str, Any] = {}  # more trained modules to checkpoint (PPO: "critic")
        self.extra_files: dict[str, Any] = {}  # more objects to checkpoint, by file name (async: "in_flight.pt")
        on_policy = plan.stage.on_policy
        try:
            a, rl = cfg.actor, cfg.rl
            seed_everything(a.seed)
            if a.npu_deterministic:
                torch.use_deterministic_algorithms(True)
            for warning in plan.warnings:
                log.warning("%s", warning)
            self.device = plan.device
            # data first: a bad dataset fails before any model loads or any directory is created
            self.dataset = (build_prompt_dataset(a, rl.max_prompt_length) if on_policy
                            else build_offline_dataset(a, plan.stage.name))
            # then the directories and the checkpoint to resume from, before any model is built:
            # a run that cannot write its results, or would load a corrupt file, stops here
            what = ("rl_config.output_dir" if rl.output_dir else "the run directory (rl_config.output_dir is not set)")
            self.locks = claim_run_dirs(cfg, run_dir, what)
            cfg = self.cfg = checked_start(cfg, load_previous_on_corruption,
                                           megatron=plan.parallel.backend == "megatron")
            self._build(cfg, plan, run_dir)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: RunConfig, plan: Plan, run_dir: Path) -> None:
        from posttrain.data.builders import build_sampler
        from posttrain.metrics.sinks import MetricsLogger, cut_jsonl, write_text_atomic

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
        self.num_threads = self._set_threads(rl.num_threads, state.get("num_threads"))
        if self.cluster is None:  # Ray workers install the plan's kernel themselves
            from posttrain.models.cpu_linear import set_cpu_linear

            set_cpu_linear(plan.cpu_linear)
        log.info("precision on %s: %s training, %s rollout (bf16 where the device computes it natively, unless "
                 "the config sets bf16: false / generate_config.dtype: float32); fp32 linear layers by %s",
                 plan.device, plan.train_dtype, plan.rollout_dtype,
                 "oneDNN (faster than the BLAS on this CPU)" if plan.cpu_linear == "onednn" else "PyTorch's BLAS")
        if plan.uses_critic:  # PPO: in this process, or colocated in the Ray actor workers
            if self.cluster is not None:
                self.critic = self.cluster.critic
            else:
                from posttrain.roles.critic import Critic

                self.critic = Critic(cfg, plan, state, self.device)
                if self.critic.save_dir is None:  # saved inside the actor's checkpoints
                    self.extra_parts["critic"] = self.critic.part
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        self.initial_model = str(state["initial_model"])
        self.sampler = build_sampler(len(self.dataset), a, state.get("sampler_state"))
        if on_policy:
            from posttrain.reward.rule_reward import RuleReward
            from posttrain.rollout.base import SamplingParams

            self.sampling = SamplingParams.from_config(cfg.generate.sampling_config.model_dump())
            if rl.rule_reward or rl.eval_data_path:  # the training scores; the held-out accuracy
                self.rule_reward = self.cluster.rule_reward if self.cluster else RuleReward.from_rl_config(rl)
            if plan.reward_model is not None:  # in this process, or colocated in the Ray actor workers
                self.reward_model = self.cluster.reward_model if self.cluster else self._reward_scorer(plan)
            self.eval_data = self._load_eval_data()
        self.logger = MetricsLogger(run_dir, rl.use_tensorboard, rl.tensorboard_log_dir, rl.use_wandb,
                                    rl.wandb_project, rl.wandb_exp_name, rl.wandb_save_dir, a.train_iters,
                                    start_iteration=self.iteration, resume_iteration=self.iteration)
        cut_jsonl(run_dir / "eval.jsonl", self.iteration)  # rows after the iteration resumed from are stale
        write_text_atomic(run_dir / "config.json", json.dumps(cfg.raw, indent=2, default=str))
        if self.iteration == 0 and self.eval_data is not None:
            self.log_eval(0)

    def _reward_scorer(self, plan: Plan):
        from posttrain.roles.reward_model import build_reward_scorer

        return build_reward_scorer(plan.reward_model, self.policy.tokenizer, self.device)

    # ---- per-iteration helpers -----------------------------------------------------------------
    def sampling_for(self, iteration: int):
        """Sampling parameters with a per-iteration seed, so runs (and resumed runs) repeat exactly."""
        base = self.sampling.seed if self.sampling.seed is not None else self.cfg.actor.seed
        return replace(self.sampling, seed=base + iteration)

    def saves_or_evaluates(self, iteration: int) -> bool:
        """Whether :meth:`after_iteration` saves a checkpoint or runs the held-out evaluation."""
        a, every = self.cfg.actor, self.cfg.rl.eval_interval
        saves = bool(a.save and a.save_interval and iteration % a.save_interval == 0)
        evaluates = self.eval_data is not None and bool(every) and iteration % every == 0 and iteration != a.train_iters
        return saves or evaluates

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
        try:
            if self.rule_reward is not None:
                self.rule_reward.close()
            if self.logger is not None:
                self.logger.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            for lock in self.locks:
                lock.release()
            self.locks = []

    def _set_threads(self, configured: int | None, stored: int | None) -> int | None:
        """Fix this process's torch threads for the run (in process; Ray workers set theirs)."""
        import torch

        from posttrain.device import cpu_threads

        if self.cluster is not None:
            return None
        threads, why = cpu_threads(configured, stored, torch.get_num_threads())
        torch.set_num_threads(threads)
        log.info("torch threads: %d (%s)", threads, why)
        return threads

    def save(self, iteration: int, extra_state: dict):
        """The one checkpoint save of a run (on Ray, rank 0 of the actor workers writes it)."""
        from posttrain.checkpoint import prune_checkpoints, save_checkpoint

        a, p = self.cfg.actor, self.policy
        self._check_finite_weights(iteration)
        state = {"iteration": iteration, "consumed_samples": self.consumed_samples,
                 "initial_model": self.initial_model, "num_threads": self.num_threads, **extra_state}
        if self.cluster is not None:
            path = self.cluster.save(a.save, iteration, sampler_state=self.sampler.state_dict(), trainer_state=state,
                                     save_optim=not a.no_save_optim, save_rng=not a.no_save_rng)
        else:
            from posttrain.train.offload import on_device

            with on_device(p.actor, getattr(self.critic, "engine", None)):  # an offloaded state is saved too
                path = save_checkpoint(a.save, iteration, p.model, p.actor.optimizer, p.actor.scheduler,
                                       tokenizer=p.tokenizer, sampler_state=self.sampler.state_dict(),
                                       trainer_state=state, save_optim=not a.no_save_optim,
                                       save_rng=not a.no_save_rng, extra=self.extra_parts, files=self.extra_files,
                                       adapter_only=bool(a.lora_ckpt_filter))
        if self.critic is not None:  # PPO: the critic's own checkpoint (critic_config.save), if it has one
            critic_path = self.critic.save(iteration, tokenizer=p.tokenizer, trainer_state=state)
            if critic_path is not None and a.keep_last:
                prune_checkpoints(critic_path.parent, a.keep_last)
        if a.keep_last:
            prune_checkpoints(a.save, a.keep_last)
        return path

    def _check_finite_weights(self, iteration: int) -> None:
        """Refuse to save weights holding NaN/inf (the loops already stop on a non-finite loss,
        gradient norm or metric; this is the last guard before such a model becomes ``latest``)."""
        import torch

        from posttrain.train.engine import NaNLossError

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
        from posttrain.metrics.sinks import open_append

        with open_append(self.run_dir / "eval.jsonl") as fh:
            fh.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        log.info("eval at iteration %d: %s", iteration, metrics)
        self.logger.log(iteration, metrics)
        return metrics
