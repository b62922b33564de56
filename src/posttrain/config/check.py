"""The one config check that ``posttrain plan`` and ``posttrain train`` both run.

Values outside the range their field declares never get here: the config refuses them when it
loads (:mod:`posttrain.config.fields`). Then, in order: the architecture keys the model built cannot
carry (:mod:`posttrain.models.arch_keys`, through :func:`posttrain.config.arch.model_arch`), the value
rules that read two keys and the seed's rules with the seed's messages (:mod:`posttrain.config.validate`),
the stage's own rules (:mod:`posttrain.config.stages`, the KL controller's ``kl_horizon`` among them), the
training backend, the layouts the model cannot be split into, the architectures the megatron backend's
mapping does not cover and a legacy Megatron checkpoint saved at another layout
(:mod:`posttrain.config.backend`), the feature combinations posttrain refuses (the one
compatibility table, :mod:`posttrain.config.compat`: every refusal that applies, together), the keys
refused on their own (:mod:`posttrain.config.features`), the reward model's settings
(:mod:`posttrain.config.reward_model`), the worker groups' shares, the multi-turn keys
(:mod:`posttrain.config.multi_turn`), the verifier names and the prompt template file, the off-policy
keys (:mod:`posttrain.config.async_rollout`) and the machine the vLLM rollout engine needs
(:mod:`posttrain.config.vllm`). Each check runs on its own and its refusal is collected
(:class:`Refusals`): the one :class:`~posttrain.errors.ConfigError` raised names every broken rule,
one per line (the seed's rules stop at their first, as the seed's do). Knobs that have no effect on
this hardware come back as one warning, and a run that saves nothing as another.
:func:`posttrain.config.plan.resolve_plan` also checks ``rl_config.device`` (:func:`check_device`),
a ``--target``'s device count, and the memory estimate, into the same list.
"""

from __future__ import annotations

import os

import re
from pathlib import Path

from posttrain.envs.config import env_options
from posttrain.config.arch import model_arch
from posttrain.config.async_rollout import check_async
from posttrain.config.backend import ModelParallel, check_backend, check_mapped, resolve_backend, uses_ray
from posttrain.config.compat import check_compat, setup_of
from posttrain.config.features import check_features, startup_warnings
from posttrain.config.megatron import MegatronConfig
from posttrain.config.multi_turn import check_multi_turn
from posttrain.config.reward_model import check_reward_model
from posttrain.config.separated import check_separated
from posttrain.config.run import RunConfig
from posttrain.config.sections import QUEUE_STRATEGIES
from posttrain.config.stages import stage_named
from posttrain.config.validate import DeviceLayout, actor_key, validate_run_config
from posttrain.extras import require
from posttrain.config.engine_choice import resolve_engine
from posttrain.config.vllm import check_vllm
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch
from posttrain.models.lora import full_rank, target_list
from posttrain.reward.verifiers import VERIFIERS, import_verifier_modules
from posttrain.paths import shipped_file

# uses_ray: posttrain.config.backend
__all__ = ["Refusals", "check_device", "check_run_config", "check_verifiers", "collect_checks", "uses_ray"]


class Refusals:
    """The :class:`~posttrain.errors.ConfigError` of each check that can run on its own, collected so
    that ``plan`` and ``train`` report every refusal at once (one per line) instead of one per run."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def run(self, check, *args, default=None, **kwargs):
        """``check(*args, **kwargs)``; on a ConfigError, its message is kept and ``default`` returned."""
        try:
            return check(*args, **kwargs)
        except ConfigError as err:
            self.add(str(err))
            return default

    def add(self, message: str) -> None:
        for line in message.split("\n"):  # a check that lists several refusals gives one per line
            if line and line not in self.messages:
                self.messages.append(line)

    def raise_any(self) -> None:
        if self.messages:
            raise ConfigError("\n".join(self.messages))


def check_run_config(cfg: RunConfig, *, device_type: str = "cpu", arch: ModelArch | None = None,
                     num_nodes: int = 1, here: bool = True) -> tuple[DeviceLayout, list[str]]:
    """Raise one ConfigError listing every broken rule (:func:`collect_checks`); return the device
    layout and the start-up warnings."""
    refusals = Refusals()
    layout, warnings = collect_checks(cfg, refusals, device_type=device_type, arch=arch, num_nodes=num_nodes,
                                      here=here)
    refusals.raise_any()
    return layout, warnings


def collect_checks(cfg: RunConfig, refusals: Refusals, *, device_type: str = "cpu", arch: ModelArch | None = None,
                   num_nodes: int = 1, here: bool = True) -> tuple[DeviceLayout | None, list[str]]:
    """Run every check, each on its own, into ``refusals``; return the device layout (None when the
    seed's rules refuse the config) and the start-up warnings.

    ``arch``: the actor's architecture, for the megatron backend's layout and mapping checks (default:
    :func:`posttrain.config.arch.model_arch`, whose refusals of architecture keys the model cannot
    carry are collected with the others). ``num_nodes``: the nodes the run will use (the seed's
    dispatch rules). ``here``: the run executes on this machine (``posttrain plan --target`` plans for
    another one, whose ``vllm`` package this machine cannot see). The seed's rules
    (:func:`~posttrain.config.validate.validate_run_config`) stop at their first broken rule, as the
    seed's do; every other check runs whatever the others found."""
    engine_warnings = refusals.run(resolve_engine, cfg, device_type, here=here, default=[])  # auto, in place
    if arch is None:  # the architecture keys: a value the model built cannot carry is refused by key
        arch = refusals.run(model_arch, cfg)
    layout = refusals.run(validate_run_config, cfg, device_type=device_type, num_nodes=num_nodes)
    stage = stage_named(cfg.actor.stage or cfg.actor.algorithm)
    refusals.run(stage.check, cfg)
    parallel = refusals.run(check_backend, cfg, arch)
    refusals.run(check_mapped, cfg, arch)
    backend = parallel.backend if parallel is not None else resolve_backend(cfg)[0]
    refusals.run(check_compat, cfg, setup_of(cfg, device_type, backend))
    refusals.run(check_features, cfg, device_type=device_type, backend=backend)
    refusals.run(check_reward_model, cfg, on_policy=stage.on_policy, dynamic_sampling=stage.dynamic_sampling(cfg))
    if parallel is not None:
        refusals.run(_check_workers, cfg, stage.on_policy, stage.uses_critic, parallel)
    for switch, module in (("use_trackio", "trackio"), ("use_mlflow", "mlflow"), ("use_swanlab", "swanlab")):
        if here and getattr(cfg.rl, switch):
            refusals.run(require, module, f"rl_config.{switch}: true")
    if here and cfg.rl.data_strategy in QUEUE_STRATEGIES:
        refusals.run(require, "transfer_queue", f"rl_config.data_strategy: {cfg.rl.data_strategy} (TransferQueue)")
    refusals.run(check_swanlab, cfg)
    if here and backend == "megatron":
        refusals.run(require, "megatron.core", f"the megatron backend ({actor_key(cfg, 'backend')}: megatron)")
    refusals.run(check_multi_turn, cfg)
    if stage.on_policy and cfg.rl.env_config is not None:  # posttrain.envs: checked before the packages
        refusals.run(_check_env, cfg)
        if here and isinstance(cfg.rl.env_config, dict) and cfg.rl.env_config.get("type") == "verifiers":
            refusals.run(require, "verifiers", "rl_config.env_config (a verifiers taskset)")
    if stage.on_policy and (cfg.rl.rule_reward or cfg.rl.eval_data_path):  # training scores, held-out accuracy
        refusals.run(check_verifiers, cfg)
    refusals.run(_check_prompt_type_path, cfg)
    refusals.run(_check_lora_keys, cfg, arch)
    warnings = engine_warnings + startup_warnings(cfg, device_type, backend=backend)
    warnings += refusals.run(check_async, cfg, default=[])
    warnings += refusals.run(check_separated, cfg, stage.uses_reference(cfg), stage.uses_critic, default=[])
    if stage.on_policy:  # rollout_engine: vllm (the vllm package, a CUDA device)
        warnings += refusals.run(check_vllm, cfg, device_type=device_type, installed=here, default=[])
    if not cfg.actor.save:
        warnings.append("actor_config.save is not set: nothing will be saved, and the trained model is lost when "
                        "the run ends; set actor_config.save (or megatron_training.save) to a directory to keep it")
    return layout, warnings


def check_swanlab(cfg: RunConfig) -> None:
    """The seed's SwanLab modes: ``local`` (files only) and ``cloud`` (the user's API key)."""
    rl = cfg.rl
    if not rl.use_swanlab:
        return
    if rl.swanlab_mode not in ("", "local", "cloud"):
        raise ConfigError(f"rl_config.swanlab_mode={rl.swanlab_mode!r}: use local (files under swanlab_save_dir, no "
                          f"network) or cloud")
    if rl.swanlab_mode == "cloud" and not os.environ.get("SWANLAB_API_KEY"):
        raise ConfigError("rl_config.swanlab_mode: cloud logs to SwanLab's service with your API key: export "
                          "SWANLAB_API_KEY (from swanlab.cn, settings), or use swanlab_mode: local")


def check_device(name: str) -> None:
    """``rl_config.device``: auto, cpu, cuda or cuda:N, and a CUDA device must exist to be named."""
    match = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", name or "")
    if match is None or (match.group(1) == "auto" and match.group(2) is not None):
        raise ConfigError(f"rl_config.device={name!r}: unknown device; use auto (CUDA when there is one, else "
                          f"the CPU), cpu, cuda or cuda:N")
    if match.group(1) != "cuda":
        return
    import torch  # lazy: keeps this config module free of torch

    if not torch.cuda.is_available():
        raise ConfigError(f"rl_config.device={name}: there is no CUDA device here (torch {torch.__version__} "
                          f"sees none); use auto or cpu")
    index, count = match.group(2), torch.cuda.device_count()
    if index is not None and int(index) >= count:
        raise ConfigError(f"rl_config.device={name}: this machine has {count} CUDA device(s) (cuda:0 to "
                          f"cuda:{count - 1})")


def check_verifiers(cfg: RunConfig) -> None:
    """Every name of ``rl_config.verifier_function`` is registered, after importing
    ``rl_config.verifier_modules``: the lookups the reward step makes when it starts
    (:class:`~posttrain.reward.rule_reward.RuleReward`). A Ray run scores on its reward workers, whose
    runtime env may reach modules this process cannot: there, a module that does not import here
    leaves the names unchecked (the workers report them)."""
    rl = cfg.rl
    if not rl.verifier_function:
        raise ConfigError("rl_config.verifier_function is empty; name at least one verifier")
    try:
        import_verifier_modules(list(rl.verifier_modules))
    except ConfigError:
        if uses_ray(cfg):
            return
        raise
    for name in rl.verifier_function:
        VERIFIERS.get(name)


def _check_env(cfg: RunConfig) -> None:
    """``rl_config.env_config`` (posttrain.envs): its keys; an environment that answers each turn needs
    a template whose ``format_observation`` wraps the answers."""
    options = env_options(cfg.rl.env_config)
    if options.multi_turn and cfg.actor.prompt_type in (None, "", "hf_chat_template"):
        raise ConfigError(f"actor_config.prompt_type={cfg.actor.prompt_type!r}: rl_config.env_config.type: openenv "
                          "wraps the environment's answers with a templates.json template's format_observation; "
                          "name one, e.g. qwen_retool")


def _check_prompt_type_path(cfg: RunConfig) -> None:
    """A ``prompt_type_path`` the config writes must exist (the shipped templates are always read)."""
    path = cfg.actor.prompt_type_path
    written = any(cfg.explicitly_set(section, "prompt_type_path") for section in ("megatron_training", "actor_config"))
    default = MegatronConfig.model_fields["prompt_type_path"].default
    if not written or not path or Path(path) == Path(default) or shipped_file(path).is_file():
        return
    raise ConfigError(f"{actor_key(cfg, 'prompt_type_path')}={path}: no such file (relative paths are read from "
                      f"the current directory, {Path.cwd()}, then configs/ paths from the shipped configs); point it at a templates JSON file or remove the key")


def _check_lora_keys(cfg: RunConfig, arch: ModelArch | None) -> None:
    """LoRA is on when ``lora_target_modules`` names layers. Written as an empty list it names none,
    and a rank or alpha other than the default without targets trains no adapter: either would be a
    full fine-tune the config did not ask for. A rank above what the targeted layers can hold
    (``arch`` known) is refused too."""
    a = cfg.actor
    written = any(cfg.explicitly_set(section, "lora_target_modules") for section in ("megatron_training",
                                                                                       "actor_config"))
    if written and a.lora_target_modules is not None and not target_list(a.lora_target_modules):
        raise ConfigError(f"{actor_key(cfg, 'lora_target_modules')}={a.lora_target_modules!r}: names no layer, so "
                          f"no adapter would be trained and the run would fine-tune every weight. Name the layers to "
                          f"adapt (e.g. [linear_qkv, linear_proj, linear_fc1, linear_fc2] or [q_proj, v_proj]), or "
                          f"remove lora_target_modules and the other lora_* keys for a full fine-tune")
    if a.lora_target_modules:
        limit = full_rank(arch, a.lora_target_modules) if arch is not None else None
        if limit is not None and a.lora_r > limit:
            raise ConfigError(f"{actor_key(cfg, 'lora_r')}={a.lora_r} is above {limit}, the full rank of the smallest "
                              f"layer that lora_target_modules adapts (min(in, out) features): a larger rank adds "
                              f"parameters and memory but no capacity. Set lora_r at most {limit}")
        return
    for key in ("lora_r", "lora_alpha"):
        default = MegatronConfig.model_fields[key].default
        if getattr(a, key) != default and any(cfg.explicitly_set(s, key) for s in ("megatron_training",
                                                                                   "actor_config")):
            raise ConfigError(f"{actor_key(cfg, key)}={getattr(a, key)} without lora_target_modules: LoRA is off, so "
                              f"this value would be ignored and every weight trained. Set lora_target_modules (e.g. "
                              f"[q_proj, v_proj]) to train an adapter, or remove {key}")


def _check_workers(cfg: RunConfig, on_policy: bool, uses_critic: bool, parallel: ModelParallel) -> None:
    """What the worker groups can run today: one actor group whose data-parallel ranks (every worker
    on the hf backend; workers // (TP x PP x CP) on the megatron backend) share each mini-batch."""

    rl = cfg.rl
    if not uses_ray(cfg):
        return
    workers = rl.actor_resource.num_npus or 1
    if not on_policy:  # SFT, DPO: the seed's rule (global batch divisible by micro batch x workers) holds
        return
    rows = rl.mini_batch_size * rl.n_samples_per_prompt
    if parallel.backend == "megatron" and rows % parallel.dp:
        raise ConfigError(f"rl_config.mini_batch_size x n_samples_per_prompt = {rows} rows cannot be shared "
                          f"equally by the data-parallel size {parallel.dp} (rl_config.actor_resource.num_npus "
                          f"{workers} // (TP x PP x CP) {parallel.model_parallel}); make it a multiple of "
                          f"{parallel.dp}")
    if parallel.backend == "hf" and rows % workers:
        raise ConfigError(f"rl_config.mini_batch_size x n_samples_per_prompt = {rows} rows cannot be shared "
                          f"equally by {workers} actor workers{' and their colocated critic' if uses_critic else ''} "
                          f"(rl_config.actor_resource.num_npus); make it a "
                          f"multiple of the worker count")
