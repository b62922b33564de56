"""Building the pieces of a run from its config: device, precision, models, data, rewards, logs.

Each function takes the config values it needs and returns one component; the trainers call them.
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path

import numpy as np

from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_supports_bf16() -> bool:
    """AMX or AVX512-BF16 on this CPU (where a bf16 matmul beats fp32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def explicitly_set(cfg: RunConfig, section_key: tuple[str, ...]) -> bool:
    """Whether a key was written in the YAML or the overrides (not just a schema default)."""
    node = cfg.raw
    for part in section_key:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def precision(cfg: RunConfig, device: str) -> tuple[str, str]:
    """(training dtype, rollout dtype). On CPU: fp32 unless bf16 is asked for explicitly and the CPU
    has bf16 matmuls; on GPU: the config's bf16 / generate_config.dtype."""
    want_train_bf16 = cfg.actor.bf16
    want_rollout = cfg.generate.dtype
    if device.startswith("cpu"):
        asked = (explicitly_set(cfg, ("megatron_training", "bf16")) or explicitly_set(cfg, ("actor_config", "bf16")))
        want_train_bf16 = want_train_bf16 and asked and cpu_supports_bf16()
        if not explicitly_set(cfg, ("generate_config", "dtype")) or not cpu_supports_bf16():
            want_rollout = "float32"
    return ("bfloat16" if want_train_bf16 else "float32"), ("bfloat16" if want_rollout == "bfloat16" else "float32")


def model_source(actor: MegatronConfig) -> str:
    """Where the actor's initial weights come from: ``load`` (a checkpoint or HF dir), else the
    tokenizer path, which for Hugging Face models is the model directory."""
    source = actor.load or actor.tokenizer_name_or_path
    if not source:
        raise ConfigError("set actor_config.load (an HF model or checkpoint directory) or "
                          "megatron_training.tokenizer_name_or_path (an HF model directory)")
    if not Path(source).exists():
        raise ConfigError(f"actor_config.load / tokenizer_name_or_path: {source} does not exist")
    return source


def build_actor_model(cfg: RunConfig, device: str):
    """The HF actor model (fp32 master weights) and its tokenizer."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models.loading import check_vocab, load_causal_lm, load_tokenizer

    source = model_source(cfg.actor)
    path, _ = resolve_checkpoint(source)
    model = load_causal_lm(path, device=device, dtype="float32")
    tok_path = cfg.actor.tokenizer_name_or_path or path
    tokenizer = load_tokenizer(tok_path)
    check_vocab(model, tokenizer, f"tokenizer {tok_path} vs model {path}")
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    return model, tokenizer, source


def build_frozen_copy(model, ref_path: str | None, device: str):
    """The reference policy: a frozen copy of the initial actor, or a model loaded from ref_path."""
    import torch

    if ref_path:
        from posttrain.checkpoint import resolve_checkpoint
        from posttrain.models.loading import load_causal_lm

        ref = load_causal_lm(resolve_checkpoint(ref_path)[0], device=device)
    else:
        ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.to(torch.float32)


def build_train_engine(model, actor: MegatronConfig, total_steps: int, dtype: str, *, metric_prefix="actor"):
    from posttrain.train.engine import TrainEngine
    from posttrain.train.optim import build_lr_scheduler, build_optimizer

    optimizer = build_optimizer(model, actor.lr, actor.weight_decay, actor.adam_beta1, actor.adam_beta2)
    scheduler = build_lr_scheduler(optimizer, lr=actor.lr, min_lr=actor.min_lr, lr_decay_style=actor.lr_decay_style,
                                   lr_warmup_fraction=actor.lr_warmup_fraction, total_steps=max(total_steps, 1))
    return TrainEngine(model, optimizer, scheduler, clip_grad=actor.clip_grad,
                       micro_batch_size=actor.micro_batch_size, dtype=dtype,
                       activation_checkpointing=actor.recompute_granularity is not None,
                       metric_prefix=metric_prefix)


def stop_token_ids(tokenizer, prompt_type: str | None, prompt_type_path: str | None) -> list[int]:
    """eos plus the template's stop words that are single tokens."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    words: list[str] = []
    if prompt_type and prompt_type != "hf_chat_template":
        from posttrain.data.templates import get_template

        path = prompt_type_path if prompt_type_path and Path(prompt_type_path).is_file() else None
        words = list(get_template(prompt_type, path).stop_words)
    for word in words:
        tid = tokenizer.convert_tokens_to_ids(word)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(ids)


def build_prompt_dataset(actor: MegatronConfig, max_prompt_length: int, data_path: str | None = None):
    from posttrain.data.datasets import PromptDataset

    prefix = data_path or actor.data_path
    if not prefix:
        raise ConfigError("megatron_training.data_path is not set: give the prefix of a preprocessed dataset")
    dataset = PromptDataset(prefix, max_prompt_length=max_prompt_length,
                            additional_keys=actor.dataset_additional_keys or ["labels"], split=actor.split)
    if len(dataset) == 0:
        why = (f" all {dataset.num_filtered} prompts are at least max_prompt_length={max_prompt_length} tokens"
               if dataset.num_filtered else "")
        raise DataError(f"the prompt dataset {prefix} is empty:{why or ' no rows'}; raise "
                        f"rl_config.max_prompt_length or check the data")
    return dataset


def build_sampler(num_samples: int, actor: MegatronConfig, state: dict | None = None):
    """The seeded, resumable batch sampler, with the seed's shuffle flags; ``state`` resumes it."""
    from posttrain.data.sampler import ResumableSampler

    full = actor.full_shuffle_instruction_dataset
    sampler = ResumableSampler.from_seed_flags(
        num_samples, actor.global_batch_size, actor.seed, no_shuffle=actor.no_shuffle,
        full_shuffle_instruction_dataset=full,
        total_samples=actor.train_iters * actor.global_batch_size if full else None)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler


def resume(source: str, model, engine, actor: MegatronConfig) -> dict:
    """Load a full checkpoint's state into ``model`` and ``engine`` when ``source`` is one (and
    ``finetune`` is off). Returns the trainer state: ``iteration`` (0 when starting fresh),
    ``consumed_samples``, ``sampler_state`` and ``initial_model`` (where the run first started,
    which is what a reference model must be loaded from after a resume)."""
    from posttrain.checkpoint import load_checkpoint, resolve_checkpoint

    _, full = resolve_checkpoint(source)
    if not full or actor.finetune:
        return {"iteration": 0, "consumed_samples": 0, "sampler_state": None, "initial_model": str(source)}
    state = load_checkpoint(source, model, engine.optimizer, engine.scheduler,
                            no_load_optim=bool(actor.no_load_optim), no_load_rng=bool(actor.no_load_rng))
    state.setdefault("initial_model", str(source))
    log.info("resumed from %s at iteration %d", state["checkpoint_dir"], int(state["iteration"]))
    return state


def build_policy(cfg: RunConfig, device: str, train_dtype: str, rollout_dtype: str, uses_reference: bool):
    """The colocated policy roles of one process: the actor model and its training engine (resumed
    from a checkpoint when ``load`` names one), the frozen reference (when used) and the rollout
    engine on the actor's model object. The in-process session and each Ray actor worker
    (:mod:`posttrain.cluster.worker`) build the same things with this function."""
    from types import SimpleNamespace

    from posttrain.rollout.base import get_engine
    from posttrain.train.dynamic_batch import apply_rl_config
    from posttrain.train.engine import TrainEngine

    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    model, tokenizer, source = build_actor_model(cfg, device)
    steps_per_iter = (a.global_batch_size // rl.mini_batch_size) * rl.epochs
    actor = build_train_engine(model, a, a.train_iters * steps_per_iter, train_dtype)
    state = resume(source, model, actor, a)
    reference = None
    if uses_reference:
        ref_path = (rl.integrated_mode_config or {}).get("ref_model_load_path")
        if ref_path is None and int(state["iteration"]) > 0:
            ref_path = str(state["initial_model"])  # a resumed actor is not the reference
        ref_model = build_frozen_copy(model, ref_path, device)
        reference = TrainEngine(ref_model, micro_batch_size=a.micro_batch_size, dtype=train_dtype)
    apply_rl_config(actor, rl, "actor")  # use_remove_padding, use_dynamic_bsz budgets
    if reference is not None:
        apply_rl_config(reference, rl, "ref")
    stops = stop_token_ids(tokenizer, a.prompt_type, a.prompt_type_path)
    # The seed's default max_num_seqs (1) is a vLLM setting; one row per batch would make the
    # native engine needlessly slow, so an unset value means 256 here.
    max_num_seqs = gen.max_num_seqs if explicitly_set(cfg, ("generate_config", "max_num_seqs")) else 256
    rollout = get_engine(rl.rollout_engine, model=model, pad_token_id=tokenizer.pad_token_id,
                         eos_token_ids=stops, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=gen.max_num_batched_tokens, dtype=rollout_dtype)
    return SimpleNamespace(model=model, tokenizer=tokenizer, source=source, actor=actor, reference=reference,
                           rollout=rollout, state=state, stop_token_ids=stops)
