"""Which training backend a run uses, and what the megatron backend refuses.

``backend`` is a key of every Megatron section (``megatron_training``, ``actor_config``, ...):
``hf`` trains Hugging Face models with PyTorch (one process, or data parallel Ray workers with DDP
or FSDP2); ``megatron`` trains Megatron-Core models split by tensor and pipeline parallelism in
Ray worker groups; null (the default) picks ``megatron`` when the actor asks for tensor, pipeline,
context or expert parallelism (a size > 1) or virtual pipeline stages, else ``hf``. The reference
and the critic follow the actor's backend and layout.

:func:`model_parallel` derives the layout (:class:`ModelParallel`, the plan's ``parallel``).
:func:`check_backend`, part of the one config check (:func:`posttrain.config.check.check_run_config`),
refuses by key a layout the model cannot be split into, and a legacy Megatron checkpoint (``load``)
saved at another layout, before any weight is loaded; :func:`check_mapped`, an architecture the
Hugging Face <-> Megatron-Core mapping does not cover (MLA, DeepSeek's experts, RoPE scaling...). What the
megatron backend does not run (a run outside Ray worker groups, the distributed optimizer on a CPU,
the features not built on it yet) are rows of the compatibility table (:mod:`posttrain.config.compat`,
the one list to shrink as they come). Keys honoured only on the megatron backend carry ``megatron=True``
in their field rule (:mod:`posttrain.config.fields`), so ``check_features`` and ``startup_warnings``
pass over them there.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass

from posttrain.config.arch import model_arch
from posttrain.config.run import RunConfig, role_sources
from posttrain.config.separated import role_devices
from posttrain.config.validate import actor_key
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.arch import MCORE_VLM, ModelArch, mcore_gap

PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size")
VPP_KEY = "num_layers_per_virtual_pipeline_stage"
ROLES = {"ref_config": "ref", "critic_config": "critic", "reward_config": "reward"}


@dataclass(frozen=True)
class ModelParallel:
    """The training backend and the actor's parallel layout (``Plan.parallel``)."""

    backend: str = "hf"  # "hf" | "megatron"
    reason: str = "no tensor/pipeline/context/expert parallelism asked"  # why, printed by `posttrain plan`
    tp: int = 1
    pp: int = 1
    vpp_layers: int | None = None  # num_layers_per_virtual_pipeline_stage
    cp: int = 1
    ep: int = 1
    dp: int = 1  # data-parallel size = workers // (tp*pp*cp)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False  # with TP > 1 only

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model together: TP x PP (x CP)."""
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        """``megatron (why): TP 2 x PP 2 x DP 1`` (the line ``posttrain plan`` prints)."""
        if self.backend == "hf":
            return f"hf ({self.reason}): DP {self.dp}"
        sizes = [f"TP {self.tp}", f"PP {self.pp}"] + ([f"CP {self.cp}"] if self.cp > 1 else []) + [f"DP {self.dp}"]
        extras = ([f"EP {self.ep} (the experts over the data-parallel ranks)"] if self.ep > 1 else []) \
            + ([f"{self.vpp_layers} layers per virtual stage"] if self.vpp_layers else []) \
            + (["sequence parallel"] if self.sequence_parallel else []) \
            + ([f"recompute {self.recompute_granularity}"] if self.recompute_granularity else []) \
            + (["distributed optimizer"] if self.use_distributed_optimizer else [])
        return f"megatron ({self.reason}): {' x '.join(sizes)}" + "".join(f", {e}" for e in extras)


def uses_ray(cfg: RunConfig) -> bool:
    """Whether the run goes to Ray: ``actor_resource.num_npus`` (alias num_gpus / num_devices) above 1,
    roles in worker groups of their own (:func:`posttrain.config.separated.role_devices`), or a Ray
    address in ``rl_config.ray_address`` or the ``RAY_ADDRESS`` environment variable."""
    rl = cfg.rl
    return ((rl.actor_resource.num_npus or 1) > 1 or bool(role_devices(cfg)) or bool(rl.ray_address)
            or bool(os.environ.get("RAY_ADDRESS")))


def role_label(cfg: RunConfig, section: str, key: str) -> str:
    """``section.key``, naming for a Megatron role the section that wrote the key."""
    if section == "actor_config":
        return actor_key(cfg, key)
    if section in ROLES:
        return f"{role_sources(cfg.raw, cfg.models, section).get(key, section)}.{key}"
    return f"{section}.{key}"


def resolve_backend(cfg: RunConfig) -> tuple[str, str]:
    """The actor's backend and why: ``("megatron", "actor_config.tensor_model_parallel_size=2 > 1")``."""
    a = cfg.actor
    if a.backend is not None:
        return a.backend, f"{actor_key(cfg, 'backend')}={a.backend}"
    for key in PARALLEL_KEYS:
        if getattr(a, key) > 1:
            return "megatron", f"{actor_key(cfg, key)}={getattr(a, key)} > 1"
    if getattr(a, VPP_KEY) is not None:
        return "megatron", f"{actor_key(cfg, VPP_KEY)}={getattr(a, VPP_KEY)} is set"
    return "hf", ModelParallel.reason


def model_parallel(cfg: RunConfig) -> ModelParallel:
    """The backend and the actor's layout (no checks: :func:`check_backend`). ``dp``: the actor
    worker processes (``actor_resource.num_npus`` with Ray, else 1) over TP x PP x CP."""
    backend, reason = resolve_backend(cfg)
    workers = (cfg.rl.actor_resource.num_npus or 1) if uses_ray(cfg) else 1
    if backend == "hf":
        return ModelParallel(backend, reason, dp=workers)
    a = cfg.actor
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    return ModelParallel(
        backend, reason, tp=tp, pp=pp, vpp_layers=getattr(a, VPP_KEY), cp=cp, ep=a.expert_model_parallel_size,
        dp=max(workers // (tp * pp * cp), 1),
        recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers, use_distributed_optimizer=a.use_distributed_optimizer,
        sequence_parallel=bool(a.sequence_parallel) and tp > 1)


def check_backend(cfg: RunConfig, arch: ModelArch | None = None) -> ModelParallel:
    """Refuse, naming the keys, a role on another backend than the actor's and a layout the model
    cannot be split into; return the layout.

    ``arch`` (default :func:`~posttrain.config.arch.model_arch`) is checked against TP and PP when
    known. Context parallel sizes > 1, and TP/PP/EP with ``backend: hf``, are refused by their
    field rules (:func:`posttrain.config.features.check_features`); the features the megatron
    backend does not run, by the compatibility table (:mod:`posttrain.config.compat`)."""
    mp = model_parallel(cfg)
    for section, role in ROLES.items():
        value = getattr(getattr(cfg, role), "backend", None) if getattr(cfg, role) is not None else None
        if value is not None and value != mp.backend:
            raise ConfigError(f"{role_label(cfg, section, 'backend')}={value}: the {role} follows the actor's backend, "
                              f"{mp.backend} ({mp.reason}); remove the key or set it to {mp.backend}")
    if mp.backend == "hf":
        return mp
    why = f" (backend megatron: {mp.reason})"
    if mp.vpp_layers is not None and mp.pp == 1:
        raise ConfigError(f"{actor_key(cfg, VPP_KEY)}={mp.vpp_layers}: virtual pipeline stages need pipeline "
                          f"parallelism; set {actor_key(cfg, 'pipeline_model_parallel_size')} > 1 or remove the "
                          f"key{why}")
    arch = arch if arch is not None else model_arch(cfg)
    _check_arch(cfg, mp, arch, why)
    _check_legacy_layout(cfg, mp, why)
    _check_lora(cfg, arch, why)
    return mp


def _check_arch(cfg: RunConfig, mp: ModelParallel, arch: ModelArch | None, why: str) -> None:
    """Heads and KV heads divisible by TP, layers by PP (and PP x layers per virtual stage), experts
    as :func:`_check_experts` wants them."""
    if arch is None:
        return  # the architecture is known only when the weights load: the engine checks it there
    tp_key, pp_key = actor_key(cfg, "tensor_model_parallel_size"), actor_key(cfg, "pipeline_model_parallel_size")
    checks = [("num_attention_heads", arch.num_attention_heads, f"{tp_key}={mp.tp}", mp.tp),
              ("num_query_groups", arch.num_kv_heads, f"{tp_key}={mp.tp}", mp.tp),
              ("num_layers", arch.num_layers, f"{pp_key}={mp.pp}", mp.pp)]
    if mp.vpp_layers:
        checks.append(("num_layers", arch.num_layers, f"{pp_key} x {actor_key(cfg, VPP_KEY)} = {mp.pp}x"
                                                       f"{mp.vpp_layers}", mp.pp * mp.vpp_layers))
    for key, value, by, size in checks:
        if value % size:
            raise ConfigError(f"{_arch_label(cfg, key)}={value} is not divisible by {by}: each rank must hold an "
                              f"equal share; choose sizes that divide it{why}")
    _check_experts(cfg, mp, arch, why)


def check_mapped(cfg: RunConfig, arch: ModelArch | None) -> None:
    """The megatron backend builds Megatron-Core's model from the Hugging Face one through the mapping
    (posttrain.models.mcore): an architecture it does not cover is refused by the config check, naming
    the key (or the loaded ``config.json``), not when the workers start. A check of its own (run by
    :func:`posttrain.config.check.collect_checks` next to :func:`check_backend`), so that the layout's
    refusals are reported with it."""
    mp = model_parallel(cfg)
    if mp.backend == "megatron" and cfg.rl.is_multimodal:  # load, or pretrained_checkpoint (finetune)
        from posttrain.config.options import checkpoint_load

        start = checkpoint_load(cfg.actor)
        if start.load:
            check_vlm_load(start.load, start.finetune)
    gap = mcore_gap(arch) if arch is not None and mp.backend == "megatron" else None
    if gap is None and arch is not None and mp.backend == "megatron" and arch.model_type in MCORE_VLM \
            and not cfg.rl.is_multimodal:  # a VLM's language model trains with its images
        gap = ("hf_model_type", f"the megatron backend trains the vision-language model {arch.model_type} with "
                                f"its images only: set rl_config.is_multimodal: true")
    if gap is None:
        return
    why = f" (backend megatron: {mp.reason})"
    key, reason = gap
    source = role_sources(cfg.raw, cfg.models, "actor_config").get(key)
    where = cfg.actor.load or cfg.actor.tokenizer_name_or_path
    label = (f"{source}.{key}" if source is not None else
             f"model_type {arch.model_type} (in {where}/config.json)" if where else f"model_type {arch.model_type}")
    raise ConfigError(f"{label}: {reason}; use backend hf (no tensor, pipeline or expert parallelism), or "
                      f"another model{why}")


def check_vlm_load(load: str, finetune: bool = False) -> None:
    """A multimodal run on the megatron backend starts from the VLM's Hugging Face directory or
    resumes its own Megatron checkpoint (an ``iter_*`` with the trained VLM in ``hf/``, ``finetune:
    false``: posttrain.roles.megatron_vlm); any other Megatron checkpoint as ``actor_config.load`` is
    refused."""
    from posttrain.models.mcore.mcore_files import is_mcore_checkpoint, iteration_dir  # lazy: torch
    from posttrain.models.vlm import saved_vlm_dir

    if not is_mcore_checkpoint(load):
        return
    it_dir = iteration_dir(load)
    if not finetune and saved_vlm_dir(it_dir) is not None:
        return
    why = ("finetune: true (its weights without its optimizer state) is not built" if finetune else
           f"{it_dir} is no iteration that a multimodal megatron run saved (no iter_XXXXXXX with the trained VLM "
           f"in hf/; a converted checkpoint has no vision tower)")
    raise ConfigError(f"actor_config.load={load}: a multimodal run on the megatron backend starts from the Hugging "
                      f"Face Qwen2.5-VL directory or resumes its own checkpoint with finetune: false; {why}. Load "
                      f"the trained VLM saved in iter_XXXXXXX/hf (a new run, its optimizer state restarts), resume "
                      f"with finetune: false, or run on backend hf")


def _check_legacy_layout(cfg: RunConfig, mp: ModelParallel, why: str) -> None:
    """A Megatron checkpoint in the legacy per-rank format (``load``) loads only at the layout it was
    saved with (TP, PP, EP, the layers of each stage); ``torch_dist`` checkpoints reshard on load. The
    same comparison as the engine's (posttrain.training.megatron.model.mcore_to_megatron), made here so
    that plan refuses what the workers would."""
    load = cfg.actor.load
    if not load or not Path(load).is_dir():
        return
    from posttrain.models.mcore import mcore_files  # lazy: torch (the rank file's args)

    try:
        if not mcore_files.is_mcore_checkpoint(load):
            return
        it_dir = mcore_files.iteration_dir(load)
        if mcore_files.is_dist_checkpoint(it_dir):
            return
        args = mcore_files.read_args(it_dir)
        saved = mcore_files.parallel_from_args(args, it_dir)
    except CheckpointError:
        return  # not a readable checkpoint: loading it reports why (posttrain.config.files, the engine)
    layers = int(args.num_layers)
    chunks = layers // (mp.pp * mp.vpp_layers) if mp.vpp_layers else 1
    wanted = mcore_files.pipeline_stages(layers, mp.pp, None, mp.vpp_layers if chunks > 1 else None)
    if (saved.tp, saved.pp, saved.ep, saved.stages) != (mp.tp, mp.pp, mp.ep, wanted):
        raise ConfigError(
            f"{actor_key(cfg, 'load')}={load}: {it_dir.name} was saved at TP {saved.tp} x PP {saved.pp} x EP "
            f"{saved.ep} with {saved.chunks} virtual stage(s) (stages {saved.stages}) in the legacy format; this "
            f"run is TP {mp.tp} x PP {mp.pp} x EP {mp.ep} with {chunks}, evenly split. Convert it to HF first "
            f"(posttrain convert --load-model-type mg --save-model-type hf --load-dir {load} --save-dir <hf dir>) "
            f"and load that directory, or run at the saved layout (torch_dist checkpoints reshard on load){why}")


def _check_lora(cfg: RunConfig, arch: ModelArch | None, why: str) -> None:
    """LoRA on the megatron backend: targets that are linears of a Megatron layer (refused by key,
    listing them), on a dense model (the experts' linears carry no adapters yet)."""
    if not cfg.actor.lora_target_modules:
        return
    from posttrain.models.lora import megatron_parts

    megatron_parts(cfg.actor.lora_target_modules)
    if arch is not None and arch.num_experts:
        raise ConfigError(f"{actor_key(cfg, 'lora_target_modules')} with {_arch_label(cfg, 'num_experts')}="
                          f"{arch.num_experts}: LoRA on a mixture-of-experts model is not built on the megatron "
                          f"backend yet; use backend hf or remove the lora_* keys{why}")


def _check_experts(cfg: RunConfig, mp: ModelParallel, arch: ModelArch, why: str) -> None:
    """Expert parallelism: a mixture-of-experts model with sequence parallelism when TP > 1, its
    experts divisible by EP, the data-parallel ranks by EP (the experts split over them), the
    torch_dist checkpoint format."""
    ep_key = actor_key(cfg, "expert_model_parallel_size")
    if not arch.num_experts:
        if mp.ep > 1:
            raise ConfigError(f"{ep_key}={mp.ep}: the model has no experts (a dense {arch.model_type} model); set it "
                              f"to 1{why}")
        return
    if mp.tp > 1 and not mp.sequence_parallel:
        tp_key, experts = actor_key(cfg, "tensor_model_parallel_size"), _arch_label(cfg, "num_experts")
        raise ConfigError(f"{tp_key}={mp.tp} with {experts}={arch.num_experts}: Megatron-Core trains a "
                          f"mixture-of-experts model with tensor parallelism only under sequence parallelism; set "
                          f"{actor_key(cfg, 'sequence_parallel')} true{why}")
    if arch.num_experts % mp.ep:
        raise ConfigError(f"{_arch_label(cfg, 'num_experts')}={arch.num_experts} is not divisible by {ep_key}="
                          f"{mp.ep}: each expert-parallel rank holds an equal share of the experts{why}")
    if mp.dp % mp.ep:
        raise ConfigError(f"{ep_key}={mp.ep} does not divide the data-parallel size {mp.dp} "
                          f"(rl_config.actor_resource.num_npus / (TP x PP x CP)): the experts split over "
                          f"data-parallel ranks; choose sizes where it does{why}")
    if cfg.actor.ckpt_format != "torch_dist":
        raise ConfigError(f"{actor_key(cfg, 'ckpt_format')}={cfg.actor.ckpt_format} with a mixture-of-experts model: "
                          f"the legacy per-rank format does not hold expert-parallel shards; use torch_dist{why}")


def _arch_label(cfg: RunConfig, key: str) -> str:
    """Where an architecture key comes from: the section (or model yaml) that wrote it, else ``load``'s config.json."""
    source = role_sources(cfg.raw, cfg.models, "actor_config").get(key)
    if source is not None:
        return f"{source}.{key}"
    where = cfg.actor.load or cfg.actor.tokenizer_name_or_path
    return f"{key} (in {where}/config.json)" if where else key
