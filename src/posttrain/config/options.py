"""The typed, frozen options a run reads, one small group per component, derived once from the
config by :func:`posttrain.config.plan.build_plan` and carried on the :class:`~posttrain.config.plan.Plan`.

Nothing below ``posttrain.commands`` reads the YAML's :class:`~posttrain.config.run.RunConfig`:
the loops, the session, the roles and the Ray workers take these groups (or plain values from
them). Types that a lower layer consumes live there (the engine's
:mod:`posttrain.training.options`, the sampler's :class:`~posttrain.rollout.base.SamplingParams`,
the tool turns' :class:`~posttrain.rollout.multi_turn.TurnLimits`, LoRA's
:class:`~posttrain.models.lora.LoraOptions`, the rule reward's
:class:`~posttrain.reward.rule_reward.RuleRewardOptions`); this module groups them per role.

Each builder below reads the config in one place and names the keys it reads, so a value can be
followed by name from the YAML to where it takes effect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from posttrain.envs.config import EnvOptions, env_options
from posttrain.checkpoint.files import CheckpointLoad
from posttrain.config.dpo_reference import dpo_reference
from posttrain.config.megatron import MegatronConfig
from posttrain.config.multi_turn import DEFAULT_PARSER, tool_config_file
from posttrain.config.run import RunConfig
from posttrain.config.runtime_env import runtime_env_vars
from posttrain.config.separated import reference_load as separated_reference_load
from posttrain.config.separated import rollout_worker
from posttrain.errors import ConfigError
from posttrain.metrics.dumps import DumpOptions
from posttrain.metrics.profiler import ProfilerOptions
from posttrain.models.lora import LoraOptions, target_list
from posttrain.data.tokenizer_files import TokenizerFiles, tokenizer_files
from posttrain.reward.rule_reward import RuleRewardOptions
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import TurnLimits
from posttrain.training.options import OptimOptions


# ---- the policy: where its weights come from, how it trains, its reference -----------------------
@dataclass(frozen=True)
class PolicyOptions:
    """The actor's keys (``megatron_training`` + ``actor_config``) that build the policy.

    ``reference_load``: where the reference's weights come from (DPO: ``ref_model``; on-policy:
    ``integrated_mode_config.ref_model_load_path``; None: a frozen copy of the actor's initial
    weights). ``moe_router_load_balancing_type`` is ``seq_aux_loss`` when ``seq_aux`` is set."""

    checkpoint: CheckpointLoad
    tokenizer: str | None
    prompt_type: str | None
    prompt_type_path: str | None
    optim: OptimOptions
    lora: LoraOptions | None = None
    reference_load: str | None = None
    share_backbone: bool = False
    offload_reference: bool = False
    seed: int = 1234
    deterministic: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.001
    ckpt_format: str = "torch_dist"
    tokenizer_files: TokenizerFiles | None = None  # tokenizer_type GPT2BPETokenizer: built into the run dir

    @property
    def load(self) -> str | None:
        return self.checkpoint.load


@dataclass(frozen=True)
class CriticOptions:
    """PPO's critic (``critic_config``, else the actor's keys): its optimizer, where it starts
    (``load``: None means the actor's initial weights), its own save directory (None: inside the
    actor's checkpoints) and the clipped value loss's ``cliprange_value``."""

    optim: OptimOptions
    checkpoint: CheckpointLoad
    save_dir: str | None
    save_optim: bool = True
    save_rng: bool = True
    cliprange_value: float = 0.5


# ---- rollout --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolOptions:
    """``multi_turn_enable``: the tools file (``tool_config_path`` resolved), the call parser
    (``tool_parser_format``), the turns' limits, and how many tool calls may run at once."""

    config_path: str
    parser: str
    limits: TurnLimits
    max_parallel_calls: int = 1


@dataclass(frozen=True)
class VllmOptions:
    """The ``generate_config`` keys ``rollout_engine: vllm`` passes to vLLM beyond the common ones."""

    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    trust_remote_code: bool = False
    enable_expert_parallel: bool = False


@dataclass(frozen=True)
class RolloutOptions:
    """The rollout engine (``rl_config.rollout_engine``) and its ``generate_config``.

    ``per_request``: the native engine's per-request decode loop (``async_engine``, or multi-turn
    ``tools``); ``speculative_tokens``: n-gram speculation; ``enforce_eager: false`` captures CUDA
    graphs on a GPU; ``sampling``: the seed's ``sampling_config`` (a run's seed per iteration is
    ``sampling.seed`` or the actor's, plus the iteration)."""

    engine: str
    sampling: SamplingParams
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    speculative_tokens: int = 0
    enforce_eager: bool = True
    per_request: bool = False
    tools: ToolOptions | None = None
    vllm: VllmOptions | None = None
    offload_weights: bool = False  # generate_config.offload_train_param (roles/policy.py; not on a CPU)


# ---- the on-policy loop ---------------------------------------------------------------------------
@dataclass(frozen=True)
class KLOptions:
    """The KL controller (``kl_ctrl_type``, ``init_kl_coef``, ``kl_target``, ``kl_horizon``) and, for
    PPO, the KL penalty in the reward (``use_kl_in_reward`` with the estimator ``kl_penalty``)."""

    ctrl_type: str = "fixed"
    init_kl_coef: float = 0.0
    target: float | None = None
    horizon: int | None = None
    in_reward: bool = False
    penalty: str = "low_var_kl"


@dataclass(frozen=True)
class AdvantageOptions:
    """``adv_estimator`` with its ``gamma`` / ``lam``, and ``turn_credit`` (multi-turn: ``trajectory``
    or ``turn``, :mod:`posttrain.algo.turn_credit`)."""

    estimator: str = "group_norm"
    gamma: float = 1.0
    lam: float = 0.95
    turn_credit: str = "trajectory"


@dataclass(frozen=True)
class UpdateOptions:
    """How an iteration's batch is trained on: ``epochs`` passes, mini-batches shuffled with
    ``shuffle_mini_batch`` (seeded by ``seed + iteration``), and the micro-batch sizes of the
    reference's and the old log-probs' passes (None: the role's ``micro_batch_size``)."""

    epochs: int = 1
    shuffle: bool = False
    seed: int = 1234
    ref_micro_batch_size: int | None = None
    old_micro_batch_size: int | None = None


@dataclass(frozen=True)
class OffPolicyOptions:
    """Sampling with other weights than the trainer's (docs/async.md): ``async_staleness`` (None:
    synchronous), a rollout worker process of its own (``separate_worker``: ``separate_rollout_worker:
    true``), partial rollout over ``partial_max_split`` iterations, and the rollout correction
    (``rollout_correction`` ``mode``, ``cap``, ``level``, ``floor``)."""

    staleness: int | None = None
    separate_worker: bool = False
    partial_max_split: int = 1
    require_max_age_all_finished: bool = True
    correction: str = "none"
    correction_cap: float = 2.0
    correction_level: str = "token"
    correction_floor: float | None = None

    @property
    def pipelined(self) -> bool:
        """Whether a rollout thread (or worker) samples ahead of the trainer."""
        return self.staleness is not None or self.separate_worker

    @property
    def partial(self) -> bool:
        return self.partial_max_split > 1

    @property
    def any(self) -> bool:
        """Whether the rollout's policy may differ from the trainer's (the old log-probs are then
        computed and compared with the rollout's)."""
        return self.pipelined or self.partial or self.correction != "none"

    @property
    def staleness_limit(self) -> int | None:
        """The most versions a trained sample may lag the trainer: ``k`` plus ``N - 1`` for a sample
        continued over ``N`` iterations; None when neither is on."""
        if self.staleness is None and not self.partial:
            return None
        return (self.staleness or 0) + self.partial_max_split - 1

    @property
    def weighted_update(self) -> bool:
        """Whether the update reads ``rollout_weights`` (a correction, or the staleness admission)."""
        return self.correction != "none" or self.staleness_limit is not None


@dataclass(frozen=True)
class DynamicSamplingOptions:
    """DAPO's ``filter_groups_*``: keep the groups whose ``metric`` scores vary, at most
    ``max_batches`` generation batches (<= 0: no cap)."""

    metric: str = "acc"
    max_batches: int = 0


@dataclass(frozen=True)
class DPOOptions:
    """``dpo_loss_type``, ``dpo_beta``, ``dpo_label_smoothing``, ``pref_ftx``, and KTO's
    ``kto_desirable_weight`` / ``kto_undesirable_weight``."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    pref_ftx: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def unpaired(self) -> bool:
        """KTO (``dpo_loss_type: kto``) trains on unpaired rows (UnpairedPreferenceHandler data)."""
        return self.loss_type == "kto"


# ---- data, schedule, logs, cluster ----------------------------------------------------------------
@dataclass(frozen=True)
class DataOptions:
    """The training data (``data_path`` with ``split``, ``dataset_additional_keys``; on-policy prompts
    of ``max_prompt_length`` tokens or more are dropped; offline samples are cut to ``seq_length``),
    its sampler (``seed``, ``no_shuffle``, ``full_shuffle_instruction_dataset``) and the held-out set
    (``rl_config.eval_data_path``, ``eval_limit`` prompts)."""

    data_path: str | None
    max_prompt_length: int = 512
    split: str | None = None
    additional_keys: tuple[str, ...] = ("labels",)
    seq_length: int = 4096
    seed: int = 1234
    no_shuffle: bool = False
    full_shuffle: bool = False
    eval_data_path: str | None = None
    eval_limit: int | None = None
    env: EnvOptions | None = None  # rl_config.env_config: the prompts (and reward) of an environment


@dataclass(frozen=True)
class ScheduleOptions:
    """Where the run writes and when: the run directory (``rl_config.output_dir``, else
    ``runs/<config name>``), checkpoints in ``save`` every ``save_interval`` iterations (0 / None:
    only the final save), the newest ``keep_last`` kept, the held-out evaluation every
    ``eval_interval`` iterations, and what a checkpoint holds; ``skip_train``: no iteration runs (the
    loaded model's held-out evaluation only)."""

    run_dir: str
    run_dir_key: str  # how the run directory is named in messages
    save: str | None = None
    save_interval: int | None = None
    eval_interval: int | None = None
    keep_last: int | None = None
    save_optim: bool = True
    save_rng: bool = True
    adapter_only: bool = False  # LoRA: lora_ckpt_filter
    num_threads: int | None = None  # rl_config.num_threads (None: chosen at start)
    skip_train: bool = False  # megatron_training.skip_train: evaluate the loaded model only

    def saves(self, iteration: int) -> bool:
        return bool(self.save and self.save_interval and iteration % self.save_interval == 0)

    def evaluates(self, iteration: int, last: int) -> bool:
        return bool(self.eval_interval) and iteration % self.eval_interval == 0 and iteration != last


@dataclass(frozen=True)
class LoggingOptions:
    """The metric sinks beyond the console and ``metrics.jsonl``."""

    use_tensorboard: bool = False
    tensorboard_dir: str | None = None
    use_wandb: bool = False
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    trackio_project: str | None = None  # None: no trackio
    mlflow_uri: str | None = None  # None: no MLflow; "": file:<run dir>/mlruns
    mlflow_experiment: str = "posttrain"
    swanlab: tuple[str, str, str, str] | None = None  # (mode, project, experiment, save dir); None: off
    log_max_throughput: bool = True


@dataclass(frozen=True)
class ClusterOptions:
    """How the workers go to Ray: ``ray_address`` (None: a local cluster, or ``RAY_ADDRESS``), the
    env vars of ``runtime_env_path`` plus ``HCCL_BUFFSIZE``, CPUs per worker, the timeout of every
    call."""

    address: str | None = None
    env_vars: tuple[tuple[str, str], ...] = ()
    cpus_per_worker: int = 1
    timeout_s: float = 1800.0
    dp_batch_balance: bool = False  # rl_config.use_dp_batch_balance: replicas' shares balanced by tokens


# ---- builders: the one place each key is read ----------------------------------------------------
def optim_options(role: MegatronConfig) -> OptimOptions:
    return OptimOptions(lr=role.lr, min_lr=role.min_lr, weight_decay=role.weight_decay, adam_beta1=role.adam_beta1,
                        adam_beta2=role.adam_beta2, lr_decay_style=role.lr_decay_style,
                        optimizer=role.optimizer, sgd_momentum=role.sgd_momentum,
                        lr_warmup_fraction=role.lr_warmup_fraction, clip_grad=role.clip_grad,
                        micro_batch_size=role.micro_batch_size,
                        activation_checkpointing=role.recompute_granularity is not None)


def checkpoint_load(role: MegatronConfig, pretrained: bool = True) -> CheckpointLoad:
    """What the role loads: ``load``; with ``pretrained_checkpoint`` (Megatron's ``--pretrained-checkpoint``;
    the actor's: ``pretrained``), while ``load`` holds no checkpoint to resume (unset, missing or empty:
    the run's first start), the pretrained checkpoint's weights only (``finetune``: iteration 0, a fresh
    optimizer and RNG); once the run has saved into ``load``, it resumes from there."""
    load, finetune = role.load or None, bool(role.finetune)
    if pretrained and role.pretrained_checkpoint and not holds_checkpoint(load):
        if load and Path(load, "config.json").is_file():
            raise ConfigError(f"load={load} names model weights and pretrained_checkpoint={role.pretrained_checkpoint} "
                              f"the weights a fresh run starts from; keep one: remove pretrained_checkpoint, or set "
                              f"load to the directory the run saves in (save), from which it resumes")
        load, finetune = role.pretrained_checkpoint, True
    return CheckpointLoad(load=load, finetune=finetune, no_load_optim=bool(role.no_load_optim),
                          no_load_rng=bool(role.no_load_rng))


def holds_checkpoint(path: str | None) -> bool:
    """``path`` is a directory with a checkpoint to resume: posttrain's ``iter_*`` (or its tracker
    file) or a Megatron checkpoint."""
    if not path or not Path(path).is_dir():
        return False
    from posttrain.checkpoint import list_checkpoints
    from posttrain.models.mcore.mcore_files import is_mcore_checkpoint

    return (Path(path, "latest_checkpointed_iteration.txt").is_file() or bool(list_checkpoints(path))
            or is_mcore_checkpoint(path))


def lora_options(role: MegatronConfig) -> LoraOptions | None:
    if not role.lora_target_modules:
        return None
    return LoraOptions(r=role.lora_r, alpha=role.lora_alpha, target_modules=tuple(target_list(role.lora_target_modules)))


def policy_options(cfg: RunConfig) -> PolicyOptions:
    a, rl = cfg.actor, cfg.rl
    reference = dpo_reference(a) if cfg.stage == "dpo" else ((rl.integrated_mode_config or {}).get("ref_model_load_path")
                                                        or separated_reference_load(cfg))
    return PolicyOptions(
        checkpoint=checkpoint_load(a), tokenizer=a.tokenizer_name_or_path or None, prompt_type=a.prompt_type,
        prompt_type_path=a.prompt_type_path, optim=optim_options(a), lora=lora_options(a),
        reference_load=reference or None,  # the seed's default ref_model is "" (unset)
        share_backbone=bool(rl.share_backbone), offload_reference=bool(rl.offload_reference), seed=a.seed,
        deterministic=bool(a.npu_deterministic),
        moe_router_load_balancing_type="seq_aux_loss" if a.seq_aux else a.moe_router_load_balancing_type,
        moe_aux_loss_coeff=a.moe_aux_loss_coeff, ckpt_format=a.ckpt_format, tokenizer_files=policy_tokenizer(a))


def policy_tokenizer(a: MegatronConfig) -> TokenizerFiles | None:
    """The files of a ``tokenizer_type`` built from files (GPT2BPETokenizer, SentencePieceTokenizer), None for a
    Hugging Face one."""
    files = tokenizer_files(a.tokenizer_type, a.vocab_file, a.merge_file, "megatron_training.", a.tokenizer_model)
    if files is not None and a.tokenizer_name_or_path:
        raise ConfigError(f"megatron_training.tokenizer_type={a.tokenizer_type} builds the tokenizer from "
                          f"{' and '.join(files.paths())}, and tokenizer_name_or_path={a.tokenizer_name_or_path} names "
                          f"another; keep one (name the model's weights with load)")
    return files


def critic_save_dir(cfg: RunConfig) -> str | None:
    """``critic_config.save`` when it names a directory other than the actor's, else None (the
    critic is then saved inside the actor's checkpoints)."""
    critic = cfg.critic
    if critic is None or not critic.save:
        return None
    if cfg.actor.save and Path(critic.save).resolve() == Path(cfg.actor.save).resolve():
        return None
    return critic.save


def critic_options(cfg: RunConfig) -> CriticOptions:
    role = cfg.critic or cfg.actor  # megatron_training + critic_config
    own = cfg.critic is not None and cfg.critic.load and cfg.critic.load != cfg.actor.load
    load = checkpoint_load(role, pretrained=False)  # no critic_config.load: the actor's initial weights
    return CriticOptions(optim=optim_options(role),
                         checkpoint=CheckpointLoad(load.load if own else None, load.finetune, load.no_load_optim,
                                                   load.no_load_rng),
                         save_dir=critic_save_dir(cfg), save_optim=not role.no_save_optim,
                         save_rng=not role.no_save_rng, cliprange_value=cfg.rl.cliprange_value)


def rollout_options(cfg: RunConfig, *, dtype: str, max_num_seqs: int, tools: ToolOptions | None) -> RolloutOptions:
    rl, gen = cfg.rl, cfg.generate
    vllm = None
    if rl.rollout_engine == "vllm":
        vllm = VllmOptions(max_model_len=gen.max_model_len, gpu_memory_utilization=gen.gpu_memory_utilization,
                           tensor_parallel_size=gen.infer_tensor_parallel_size, enforce_eager=gen.enforce_eager,
                           enable_prefix_caching=gen.enable_prefix_caching, trust_remote_code=gen.trust_remote_code,
                           enable_expert_parallel=gen.enable_expert_parallel)
    return RolloutOptions(
        engine=rl.rollout_engine, dtype=dtype,
        sampling=replace(SamplingParams.from_config(gen.sampling_config.model_dump()),
                         truncated_logprobs=rl.truncated_sampling_logprobs),
        max_num_seqs=max_num_seqs, max_num_batched_tokens=gen.max_num_batched_tokens,
        max_model_len=gen.max_model_len, speculative_tokens=gen.num_speculative_tokens,
        enforce_eager=gen.enforce_eager, per_request=bool(rl.multi_turn_enable or rl.async_engine), tools=tools,
        vllm=vllm, offload_weights=bool(gen.offload_train_param))


def tool_options(cfg: RunConfig) -> ToolOptions | None:
    rl = cfg.rl
    if not rl.multi_turn_enable:
        return None
    limits = TurnLimits(max_tool_calls=rl.max_tool_calls, max_total_response_length=rl.max_total_response_length,
                        max_parallel_calls=rl.max_parallel_calls, max_tool_response_length=rl.max_tool_response_length,
                        truncate_side=rl.tool_response_truncate_side or "left",
                        max_model_len=cfg.generate.max_model_len)
    return ToolOptions(config_path=str(tool_config_file(rl.tool_config_path)),
                       parser=rl.tool_parser_format or DEFAULT_PARSER, limits=limits,
                       max_parallel_calls=rl.max_parallel_calls)


def kl_options(cfg: RunConfig) -> KLOptions:
    rl = cfg.rl
    return KLOptions(ctrl_type=rl.kl_ctrl_type, init_kl_coef=rl.init_kl_coef, target=rl.kl_target,
                     horizon=rl.kl_horizon, in_reward=bool(rl.use_kl_in_reward), penalty=rl.kl_penalty)


def advantage_options(cfg: RunConfig) -> AdvantageOptions:
    rl = cfg.rl
    return AdvantageOptions(estimator=rl.adv_estimator, gamma=rl.gamma, lam=rl.lam, turn_credit=rl.turn_credit)


def update_options(cfg: RunConfig, *, on_policy: bool) -> UpdateOptions:
    rl = cfg.rl
    return UpdateOptions(epochs=rl.epochs if on_policy else 1, shuffle=bool(rl.shuffle_mini_batch), seed=cfg.actor.seed,
                         ref_micro_batch_size=rl.ref_forward_micro_batch_size,
                         old_micro_batch_size=rl.actor_forward_micro_batch_size)


def off_policy_options(cfg: RunConfig) -> OffPolicyOptions:
    rl = cfg.rl
    return OffPolicyOptions(staleness=rl.async_staleness, separate_worker=rollout_worker(cfg),
                            partial_max_split=rl.partial_rollout_max_split,
                            require_max_age_all_finished=rl.require_max_age_all_finished,
                            correction=rl.rollout_correction, correction_cap=rl.rollout_correction_cap,
                            correction_level=rl.rollout_correction_level,
                            correction_floor=rl.rollout_correction_floor)


def dynamic_sampling_options(cfg: RunConfig) -> DynamicSamplingOptions:
    rl = cfg.rl
    return DynamicSamplingOptions(metric=rl.filter_groups_metric, max_batches=rl.filter_groups_max_batches)


def dpo_options(cfg: RunConfig) -> DPOOptions:
    a = cfg.actor
    return DPOOptions(loss_type=a.dpo_loss_type, beta=a.dpo_beta, label_smoothing=a.dpo_label_smoothing,
                      pref_ftx=a.pref_ftx, desirable_weight=a.kto_desirable_weight,
                      undesirable_weight=a.kto_undesirable_weight)


def rule_reward_options(cfg: RunConfig) -> RuleRewardOptions:
    rl = cfg.rl
    return RuleRewardOptions(
        verifiers=tuple(rl.verifier_function), weights=tuple(rl.verifier_weight), parallel=rl.verifier_parallel,
        timeout=rl.verifier_timeout, modules=tuple(rl.verifier_modules or ()),
        overlong_buffer_enable=bool(rl.overlong_buffer_enable), overlong_buffer=rl.overlong_buffer,
        overlong_buffer_penalty_factor=rl.overlong_buffer_penalty_factor, rollout_max_tokens=rl.rollout_max_tokens)


def data_options(cfg: RunConfig) -> DataOptions:
    a, rl = cfg.actor, cfg.rl
    return DataOptions(data_path=a.data_path or None, max_prompt_length=rl.max_prompt_length, split=a.split,
                       additional_keys=tuple(a.dataset_additional_keys or ["labels"]), seq_length=a.seq_length,
                       seed=a.seed, no_shuffle=bool(a.no_shuffle),
                       full_shuffle=bool(a.full_shuffle_instruction_dataset),
                       eval_data_path=rl.eval_data_path or None, eval_limit=rl.eval_limit,
                       env=env_options(rl.env_config))


def schedule_options(cfg: RunConfig) -> ScheduleOptions:
    a, rl = cfg.actor, cfg.rl
    run_dir = rl.output_dir or str(Path("runs") / cfg.name)
    key = "rl_config.output_dir" if rl.output_dir else "the run directory (rl_config.output_dir is not set)"
    return ScheduleOptions(run_dir=str(run_dir), run_dir_key=key, save=a.save or None, save_interval=a.save_interval,
                           eval_interval=rl.eval_interval, keep_last=a.keep_last, save_optim=not a.no_save_optim,
                           save_rng=not a.no_save_rng, adapter_only=bool(a.lora_ckpt_filter),
                           num_threads=rl.num_threads, skip_train=bool(a.skip_train))


def profiler_options(cfg: RunConfig, run_dir: str) -> ProfilerOptions | None:
    """``profiler_config.integrated`` when ``profile`` or ``mstx`` is on (posttrain.metrics.profiler);
    ``mstx`` alone: phase ranges, no trace."""
    p = cfg.profiler
    if not p.profile and not p.mstx:
        return None
    if not p.profile:
        return ProfilerOptions(save_path="", start=0, end=0, mstx=True)
    stages = [p.stage] if isinstance(p.stage, str) else list(p.stage)
    ranks = None if p.profile_ranks in ("all", None) else tuple(int(r) for r in (
        p.profile_ranks if isinstance(p.profile_ranks, (list, tuple)) else [p.profile_ranks]))
    return ProfilerOptions(save_path=p.profile_save_path or str(Path(run_dir) / "profile"), start=p.profile_step_start,
                           end=p.profile_step_end, stages=None if "all" in stages else tuple(stages),
                           level=p.profile_level, cpu=p.profile_with_cpu, device=p.profile_with_npu,
                           record_shapes=p.profile_record_shapes, memory=p.profile_with_memory,
                           stack=p.profile_with_module, analysis=p.profile_analysis, ranks=ranks, mstx=p.mstx)


def dump_options(cfg: RunConfig) -> DumpOptions | None:
    """``msprobe_config`` when ``msprobe`` is on (posttrain.metrics.dumps)."""
    m = cfg.msprobe
    if not m.msprobe:
        return None
    switches = {"key_data": m.key_data_dump, "actor_infer": m.actor_infer_dump, "actor_train": m.actor_train_dump,
                "reference": m.reference_dump, "critic_train": m.critic_train_dump}
    return DumpOptions(dump_path=m.dump_path, roles=frozenset(role for role, on in switches.items() if on),
                       configurations=m.configurations_dump, step_start=m.step_start, step_end=m.step_end,
                       token_start=m.token_range_start, token_end=m.token_range_end)


def logging_options(cfg: RunConfig) -> LoggingOptions:
    rl = cfg.rl
    return LoggingOptions(use_tensorboard=bool(rl.use_tensorboard), tensorboard_dir=rl.tensorboard_log_dir or None,
                          use_wandb=bool(rl.use_wandb), wandb_project=rl.wandb_project or "",
                          wandb_exp_name=rl.wandb_exp_name or "", wandb_save_dir=rl.wandb_save_dir or "",
                          trackio_project=(rl.trackio_project or "posttrain") if rl.use_trackio else None,
                          mlflow_uri=rl.mlflow_tracking_uri if rl.use_mlflow else None,
                          mlflow_experiment=rl.mlflow_experiment or "posttrain",
                          swanlab=(rl.swanlab_mode or "local", rl.swanlab_project or "posttrain", rl.swanlab_exp_name,
                                   rl.swanlab_save_dir) if rl.use_swanlab else None,
                          log_max_throughput=bool(rl.log_max_throughput))


def cluster_options(cfg: RunConfig) -> ClusterOptions:
    rl = cfg.rl
    return ClusterOptions(address=rl.ray_address or None, env_vars=tuple(sorted(runtime_env_vars(cfg).items())),
                          cpus_per_worker=rl.ray_num_cpus_per_worker, timeout_s=float(rl.ray_timeout_s),
                          dp_batch_balance=bool(rl.use_dp_batch_balance))


def resolved_config_json(cfg: RunConfig) -> str:
    """The config as the run wrote it (``config.json`` of the run directory)."""
    return json.dumps(cfg.raw, indent=2, default=str)
