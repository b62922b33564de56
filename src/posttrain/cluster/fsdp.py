"""FSDP2 for the actor workers (``rl_config.ray_sharding: fsdp2``): parameters, gradients and
AdamW state sharded over the workers instead of replicated (DDP).

* **Sharding**: every decoder layer (the HF model's ``_no_split_modules`` classes) and then the
  whole model get ``fully_shard``. A VLM's frozen vision tower (``freeze_vision_tower``) is not
  sharded: its parameters are left out of FSDP2 (``ignored_params``) and stay whole on every rank,
  so the tower's forward, which posttrain runs outside the model's forward (the image features,
  :mod:`posttrain.training.multimodal`), reads full weights; the embedding lookup that the
  features are scattered into runs in the model's forward, whose root unit gathers the embedding.
  The parameters become DTensors, so the optimizer and the LR schedule are rebuilt on them; a
  state resumed into the unsharded model is carried over (``get_optimizer_state_dict`` before,
  ``set_optimizer_state_dict`` after).
* **Precision**: with bf16 training (``megatron_training.bf16``, on a GPU, refused there with
  images: row ``mm-fsdp2-bf16``; on a CPU with bf16 units) the shards get
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the parameters are gathered
  and computed in bf16, gradients are reduced in fp32, and the sharded master weights and AdamW
  state stay fp32.
* **Update**: unchanged :class:`TrainEngine` code. FSDP2 averages gradients over ranks (reduce-
  scatter) like DDP, so the engine's loss scale by the world size applies; ``clip_grad_norm_``
  computes the global norm of the DTensor gradients.
* **Inference** (rollout, old log-probs) runs inside :func:`gathered`: all ranks all-gather the
  full parameters once and keep them for the call (``reshard_after_forward`` off), so a worker
  may run any number of forward passes, or none, without further collectives; the shards are
  restored afterwards. Every rank must enter it, so the group calls all workers, even with no rows.
* **A vLLM rollout engine** (its own copy of the weights) is synced inside :func:`gathered` too:
  :class:`GatheredView` reads the full parameters that the gather put in place (plain tensors, by
  their Hugging Face names, one decoder layer after another), so every rank's engine loads the
  whole model after one gather, and the probe runs the gathered model with no further collective.
* **Checkpoints**: all ranks gather the full model and optimizer state (a collective); rank 0
  writes them through :func:`posttrain.checkpoint.save_checkpoint` in the in-process layout
  (optimizer state keyed by parameter index), so the checkpoint resumes on any number of workers
  with DDP, FSDP2 or in one process.
* **LoRA** (a PEFT model): the same sharding, the frozen base included (its shards never get a
  gradient; only the adapter is in the optimizer). Rollout, the old log-probs and the reference
  with ``share_backbone`` (the adapter off) run inside :func:`gathered`; the rollout merges the
  adapter into the gathered base weights (:func:`posttrain.models.lora.merged`), and a vLLM engine
  takes the merged weights under the base model's names. A save gathers the adapter (and, without
  ``lora_ckpt_filter``, the base) and writes PEFT's format, as DDP and one process do.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from posttrain.errors import ConfigError
from posttrain.rollout.vllm_weights import ModelView, hf_name
from posttrain.training.optim import build_role_optimizer, build_scheduler
from posttrain.training.options import OptimOptions


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # lazy: ~0.8 s; DDP imports this module

    return StateDictOptions(full_state_dict=True, **kw)


def mixed_precision(compute_dtype):
    """FSDP2's precision policy: parameters gathered in ``compute_dtype`` (None: as stored, fp32)
    and gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # lazy: FSDP2 API (torch >= 2.6); DDP imports this module

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard(model, engine, optim: OptimOptions, total_steps: int) -> list[str]:
    """``fully_shard`` the decoder layers and the model; rebuild ``engine``'s optimizer and
    scheduler on the sharded parameters, carrying over their state. Returns the parameter names
    in the optimizer's order (the index order of an in-process optimizer state)."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: ~0.8 s; DDP imports this module
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(engine.autocast_dtype)

    names = [name for name, _ in model.named_parameters()]
    has_state = bool(engine.optimizer.state)
    full_optim = get_optimizer_state_dict(model, engine.optimizer, options=_options()) if has_state else None
    scheduler_state = engine.scheduler.state_dict() if engine.scheduler is not None else None
    layers = set(getattr(model, "_no_split_modules", None) or [])
    tower = whole_tower(model)
    kept = set() if tower is None else set(tower.modules())
    for module in list(model.modules()):
        if type(module).__name__ in layers and module not in kept:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy, ignored_params={p for m in kept for p in m.parameters(recurse=False)})
    engine.optimizer = build_role_optimizer(model, optim)
    if engine.offload is not None:  # generate_config.offload_train_*: the new optimizer's state moves
        engine.offload.optimizer = engine.optimizer
    engine.scheduler = build_scheduler(engine.optimizer, optim, max(total_steps, 1))
    if full_optim is not None:
        set_optimizer_state_dict(model, engine.optimizer, full_optim, options=_options())
    if scheduler_state is not None:
        engine.scheduler.load_state_dict(scheduler_state)
    return names


def whole_tower(model) -> torch.nn.Module | None:
    """A VLM's vision tower, kept whole on every rank (frozen: no gradient to reduce); None for a
    text model. A trained tower is refused by the config (row ``mm-fsdp2-tower``)."""
    from posttrain.training.multimodal import vision_tower

    try:
        tower = vision_tower(model)
    except AttributeError:  # a causal LM: no .model.visual
        return None
    if any(param.requires_grad for param in tower.parameters()):
        raise ConfigError("rl_config.ray_sharding: fsdp2 shards a VLM with a frozen vision tower only; set "
                         "rl_config.freeze_vision_tower: true or ray_sharding: ddp")
    return tower


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP2 API (torch >= 2.6); DDP imports this module

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model, enabled: bool):
    """Full parameters on every rank for the duration (a collective on entry and exit)."""
    if not enabled:
        yield
        return
    modules = fsdp_modules(model)
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        for module in modules:
            module.reshard()


class GatheredView(ModelView):
    """The FSDP2 model inside :func:`gathered` as the vLLM engine sees it (a
    :class:`~posttrain.rollout.vllm_weights.ModelView`): its weights are the gathered full
    parameters and persistent buffers, read from the modules directly (``state_dict()`` would
    put the shards back in place), shared tensors once, by their Hugging Face names (a PEFT
    model's base weights under the base model's names, its adapter left out: the caller merged it)."""

    def weights(self):
        seen: set[int] = set()
        for module_name, module in self.model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            persistent = [(n, b) for n, b in module.named_buffers(recurse=False)
                          if n not in module._non_persistent_buffers_set]
            for name, tensor in [*module.named_parameters(recurse=False), *persistent]:
                if tensor is None or id(tensor) in seen:
                    continue
                assert not hasattr(tensor, "full_tensor"), f"{prefix}{name} is still a shard: sync inside gathered()"
                seen.add(id(tensor))
                name = hf_name(prefix + name)
                if name is not None:
                    yield name, tensor.detach()


def full_state(model, optimizer, names: list[str], *, trainable_only: bool = False) -> tuple[dict, dict]:
    """(full model state dict, optimizer state keyed like an in-process optimizer's), on CPU, on
    rank 0 (the other ranks get empty dicts). A collective: every rank calls it. ``trainable_only``
    (a LoRA adapter saved alone): the frozen base is not gathered."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: ~0.8 s; DDP imports this module
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    weights = get_model_state_dict(model, options=_options(cpu_offload=True, ignore_frozen_params=trainable_only))
    optim = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if "state" not in optim:  # with cpu_offload only rank 0 receives the full state
        return weights, {}
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: value for name, value in optim["state"].items()}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in optim["param_groups"]]
    return weights, {"state": state, "param_groups": groups}


class FullCopy:
    """What save_checkpoint needs from a model and an optimizer, from gathered full states: a CPU
    HF model with the full weights (``save_pretrained``; a VLM: ``AutoModelForImageTextToText``) and
    the optimizer's ``state_dict``. A PEFT (LoRA) model: a PEFT copy holding the gathered tensors,
    the rest of it never allocated (:func:`posttrain.models.lora.meta_copy`; with the adapter alone, the base is not read)."""

    def __init__(self, model, weights: dict, optim_state: dict):
        if hasattr(model, "peft_config"):
            from posttrain.models.lora import meta_copy  # lazy: peft (seconds), LoRA only

            copy = meta_copy(model, weights)
        else:
            vlm = hasattr(model.config, "vision_config")  # a VLM: its own class, the tower included
            copy = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(model.config)
            copy.load_state_dict(weights, strict=False)
        self.model, self.optim_state = copy, optim_state

    def state_dict(self) -> dict:
        return self.optim_state
