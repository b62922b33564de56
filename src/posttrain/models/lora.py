"""LoRA on the hf backend, through PEFT: the seed's keys (``lora_r``, ``lora_alpha``,
``lora_target_modules``) to a ``peft.LoraConfig``, the base weights frozen, the adapter the only
trainable parameters.

The seed names its targets by Megatron module; each maps to the Hugging Face linears it fuses::

    linear_qkv -> q_proj, k_proj, v_proj      linear_fc1 -> gate_proj, up_proj
    linear_proj -> o_proj                      linear_fc2 -> down_proj

Hugging Face names are taken as they are. A target that matches no linear of the model is refused
with the names that exist.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from posttrain.errors import ConfigError

MEGATRON_TO_HF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraOptions:
    """The actor's LoRA keys: rank ``lora_r``, ``lora_alpha`` and ``lora_target_modules`` (Megatron
    or Hugging Face linear names)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]


def lora_sizes(arch, targets: Any, rank: int) -> tuple[int, int]:
    """``(adapter, targeted)``: the parameters of a LoRA adapter of ``rank`` on ``targets`` of the
    model ``arch`` (a :class:`~posttrain.models.arch.ModelArch`), ``rank x (in + out)`` per adapted
    linear, and of the base weights it adapts (``in x out`` each; the merged rollout saves a copy
    of those). The dense MLP's linears: a mixture-of-experts model's experts are not counted."""
    names = _target_shapes(arch, targets)
    return (arch.num_layers * rank * sum(i + o for i, o in names), arch.num_layers * sum(i * o for i, o in names))


def _target_shapes(arch, targets: Any) -> list[tuple[int, int]]:
    """``(in, out)`` of each dense linear that ``targets`` name in ``arch`` (unknown names left out)."""
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    shapes = {**_attention_shapes(arch), "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}
    return [shapes[n] for n in {n for t in target_list(targets) for n in MEGATRON_TO_HF.get(t, (t,))} if n in shapes]


def _attention_shapes(arch) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of the attention's linears: multi-head / grouped-query, or DeepSeek-V3's MLA."""
    h, heads, mla = arch.hidden_size, arch.num_attention_heads, getattr(arch, "mla", None)
    if mla is None:
        q, kv = heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    qk = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    shapes = {"kv_a_proj_with_mqa": (h, mla.kv_lora_rank + mla.qk_rope_head_dim),
              "kv_b_proj": (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
              "o_proj": (heads * mla.v_head_dim, h)}
    if mla.q_lora_rank is None:
        return {**shapes, "q_proj": (h, qk)}
    return {**shapes, "q_a_proj": (h, mla.q_lora_rank), "q_b_proj": (mla.q_lora_rank, qk)}


def full_rank(arch, targets: Any) -> int | None:
    """The largest rank an update of the linears ``targets`` name in ``arch`` can have (the smallest
    ``min(in, out)``): a LoRA rank above it adds parameters but no capacity. None when no target is known."""
    shapes = _target_shapes(arch, targets)
    return min(min(i, o) for i, o in shapes) if shapes else None


def target_list(targets: Any) -> list[str]:
    """``lora_target_modules`` as a list of names (the seed writes a list; a comma-separated string is
    accepted too)."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"actor_config.lora_target_modules={targets!r}: give a list of module names, e.g. "
                          f"[linear_qkv, linear_proj, linear_fc1, linear_fc2] or [q_proj, v_proj]")
    return list(targets)


def hf_targets(targets: Any, model) -> list[str]:
    """The Hugging Face module names (last name component) that ``targets`` select in ``model``;
    refuses a target that matches none of its linear layers, listing those that exist."""
    import torch  # lazy: config/ imports lora.py without torch

    linears = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"})
    out: list[str] = []
    for target in target_list(targets):
        names = MEGATRON_TO_HF.get(target, (target,))
        missing = [n for n in names if n not in linears]
        if missing:
            raise ConfigError(f"actor_config.lora_target_modules: {target!r} matches no linear layer of the model "
                              f"({', '.join(missing)} not found); its linear layers are {', '.join(linears)} "
                              f"(or the Megatron names {', '.join(MEGATRON_TO_HF)})")
        out += [n for n in names if n not in out]
    return out


HF_TO_MEGATRON = {hf: mg for mg, names in MEGATRON_TO_HF.items() for hf in names}


def megatron_parts(targets: Any) -> dict[str, tuple[str, ...]]:
    """The megatron backend's adapters: for each Megatron linear that ``lora_target_modules`` adapt,
    the HF linears (one PEFT adapter each) it carries, in its row order; refuses a name that is no
    linear of a Megatron layer, listing those that are."""
    wanted: set[str] = set()
    for target in target_list(targets):
        if target not in MEGATRON_TO_HF and target not in HF_TO_MEGATRON:
            known = "; ".join(f"{mg} ({', '.join(names)})" for mg, names in MEGATRON_TO_HF.items())
            raise ConfigError(f"actor_config.lora_target_modules: {target!r} is not a linear of a Megatron layer; the "
                              f"megatron backend adapts {known}: give those names (Megatron or HF)")
        wanted.update(MEGATRON_TO_HF.get(target, (target,)))
    return {mg: tuple(n for n in names if n in wanted) for mg, names in MEGATRON_TO_HF.items()
            if any(n in wanted for n in names)}


def lora_config(options: LoraOptions, model):
    """The ``peft.LoraConfig`` of the LoRA keys: rank ``lora_r``, ``lora_alpha``, no dropout, no bias."""
    from peft import LoraConfig  # lazy: peft (seconds), LoRA only

    if options.r is None or options.r < 1:
        raise ConfigError(f"actor_config.lora_r={options.r}: the LoRA rank must be an integer >= 1")
    if options.alpha is None or options.alpha <= 0:
        raise ConfigError(f"actor_config.lora_alpha={options.alpha}: must be > 0 (the update is scaled by "
                          f"lora_alpha / lora_r)")
    # a vision-language model: the adapter on the language model only (its vision tower has linears of the same names)
    exclude = r".*\bvisual\b.*" if hasattr(getattr(model, "model", None), "visual") else None
    return LoraConfig(r=int(options.r), lora_alpha=options.alpha, lora_dropout=0.0, bias="none",
                      target_modules=hf_targets(options.target_modules, model), task_type="CAUSAL_LM",
                      exclude_modules=exclude)


def add_adapter(model, options: LoraOptions):
    """``model`` (an HF causal LM) with a fresh LoRA adapter of ``options`` (PEFT's initialisation:
    A random, B zero, so the adapted model starts as the base)."""
    from peft import get_peft_model  # lazy: as in lora_config

    return get_peft_model(model, lora_config(options, model))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


BASE_DIR = "base"  # a LoRA checkpoint's own copy of its frozen base (saved without lora_ckpt_filter)


def adapter_base(path: str | Path) -> Path:
    """The base model of the adapter in ``path``: the checkpoint's ``base/`` (a LoRA run saved
    without ``lora_ckpt_filter``; a subdirectory, since Transformers would load an adapter found
    next to the weights by itself), else the ``base_model_name_or_path`` of its
    ``adapter_config.json``, which must exist here."""
    from posttrain.checkpoint import is_hf_model_dir  # lazy: config/ imports lora.py without torch

    if is_hf_model_dir(Path(path) / BASE_DIR):
        return Path(path) / BASE_DIR

    config = Path(path) / ADAPTER_CONFIG
    base = read_adapter_config(config).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ConfigError(f"{config}: its base model {base!r} is not a directory here; {path} holds a LoRA adapter "
                          f"only (lora_ckpt_filter), so the base it was trained on must be at that path (or edit "
                          f"base_model_name_or_path)")
    return Path(base)


def check_adapter_wanted(path: str | Path, options: LoraOptions | None) -> None:
    """A checkpoint in ``path`` that holds a LoRA adapter is continued only by a run with LoRA keys."""
    if options is None and is_adapter_dir(path):
        raise ConfigError(f"{path} holds a LoRA adapter: set actor_config.lora_target_modules to keep training it, "
                          f"or merge it into the base first (posttrain convert --merge-lora --load-dir {path} "
                          f"--save-dir <dir>)")


def check_adapter_keys(path: str | Path, options: LoraOptions, model) -> None:
    """The adapter saved in ``path`` has the run's ``lora_r``, ``lora_alpha`` and targets; else the
    run would silently continue another adapter than its config describes."""
    check_adapter_matches(path, options, hf_targets(options.target_modules, model))


def check_adapter_matches(path: str | Path, options: LoraOptions, targets) -> None:
    """The adapter saved in ``path`` has the run's ``lora_r`` and ``lora_alpha`` and the module names
    ``targets`` (both backends: the HF model's names, or the Megatron layers' HF names)."""
    saved = read_adapter_config(Path(path) / ADAPTER_CONFIG)
    wanted = {"r": int(options.r), "lora_alpha": options.alpha, "target_modules": sorted(targets)}
    found = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
             "target_modules": sorted(saved.get("target_modules") or [])}
    keys = {"r": "lora_r", "lora_alpha": "lora_alpha", "target_modules": "lora_target_modules"}
    for field, value in wanted.items():
        if found[field] != value:
            raise ConfigError(f"actor_config.{keys[field]}: the run asks for {value} but the adapter in {path} has "
                              f"{found[field]}; give the adapter's value to continue it")


def load_adapter(model, path: str | Path, *, trainable: bool = True):
    """``model`` (the base) with the PEFT adapter saved in ``path``; refuses an adapter made for
    another architecture (its target shapes do not fit), naming both."""
    from peft import PeftModel  # lazy: as in lora_config

    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path}: this LoRA adapter does not fit the model "
                          f"{getattr(model.config, '_name_or_path', '') or model.config.model_type} ({first}); load "
                          f"the base model it was trained on") from None


@contextlib.contextmanager
def merged(model) -> Iterator[None]:
    """For the duration, the adapter merged into the base weights and switched off, so the base
    layers alone compute the adapted model (W + (alpha / r) B A); then each base weight is put back
    from a saved copy: bit-exact, unlike subtracting B A again."""
    import torch  # lazy: config/ imports lora.py without torch
    from peft.tuners.lora import LoraLayer

    saved = []
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
            weight = layer.get_base_layer().weight
            saved.append((weight, weight.detach().clone()))
            for name in layer.active_adapters:
                weight += layer.get_delta_weight(name).to(weight.dtype)
    try:
        with model.disable_adapter():
            yield
    finally:
        with torch.no_grad():
            for weight, base in saved:
                weight.copy_(base)


class MergedRollout:
    """A rollout engine over a PEFT model that samples from the merged weights (:func:`merged`):
    a :class:`~posttrain.rollout.base.RolloutEngine` around ``engine``, whose other attributes it
    forwards (``supports_rounds``, ``max_num_seqs``). An engine that samples from the model object
    (native) gets the adapter merged for each call; an engine with its own copy of the weights
    (``holds_weights``: vLLM) gets the merged weights at every sync and samples from its copy."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model

    def generate(self, prompt_token_ids, n, sampling, stop_token_ids=None, prompt_keys=None, **engine_options):
        """The engine's ``generate`` (with its own options, such as partial rollout's
        ``max_new_tokens``) on the merged weights."""
        merging = contextlib.nullcontext() if self.holds_weights else merged(self.model)
        with merging:
            return self.engine.generate(prompt_token_ids, n, sampling, stop_token_ids=stop_token_ids,
                                        prompt_keys=prompt_keys, **engine_options)

    @property
    def holds_weights(self) -> bool:
        return bool(getattr(self.engine, "holds_weights", False))

    def sync_weights(self, model) -> int | None:
        """``model``: the PEFT model this engine samples for, or a view of it (FSDP2's gathered
        parameters); the adapter is merged into the base weights of the model itself."""
        if not self.holds_weights:
            return self.engine.sync_weights(model)
        peft = model if hasattr(model, "peft_config") else self.model  # a view: the model it shows
        with merged(peft):  # the adapted weights, under the base model's names
            return self.engine.sync_weights(model)

    def pop_metrics(self) -> dict[str, float]:
        return self.engine.pop_metrics()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class AdapterOff:
    """``rl_config.share_backbone``: the reference is the actor's own model with its adapter switched
    off (a :class:`~posttrain.training.base.ReferenceEngine`: the engine's log-prob methods on it), so
    no second copy of the model is held. Other attributes are the engine's (set ones too:
    ``dp_group``)."""

    def __init__(self, engine, model):
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "model", model)

    def compute_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None):
        with self.model.disable_adapter():
            return self.engine.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size)

    def compute_pair_logps(self, batch, *, average=False, micro_batch_size=None):
        with self.model.disable_adapter():
            return self.engine.compute_pair_logps(batch, average=average, micro_batch_size=micro_batch_size)

    def __getattr__(self, name: str):
        if name.startswith("compute_"):  # with the adapter on, it would not be the reference's
            raise AttributeError(f"AdapterOff (the reference) has no {name}")
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.engine, name, value)


def meta_copy(model, weights: dict):
    """A PEFT model shaped like the PEFT ``model`` (its base's config, its adapter's
    ``LoraConfig``) holding ``weights`` (state-dict keys of ``model``, CPU tensors; FSDP2's gathered
    full state): built on the meta device, so the tensors not given are never allocated. With the
    adapter's tensors alone (``lora_ckpt_filter``) its ``save_pretrained`` writes the adapter in
    PEFT's format and the base is never read; with the full state it is a whole model."""
    import torch  # lazy: config/ imports lora.py without torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model.config)
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    out = get_peft_model(base, config, adapter_name=model.active_adapter)
    missing = [k for k in out.state_dict() if ".lora_" in k and k not in weights]
    assert not missing, f"the gathered state lacks adapter tensors {missing[:3]}"
    out.load_state_dict(weights, strict=False, assign=True)
    if all(not t.is_meta for t in out.state_dict().values()):
        out.get_base_model().tie_weights()  # the whole model: tied weights shared again, as loaded
    return out


def load_merged(path: str | Path, **kwargs):
    """The HF causal LM in ``path`` (``load_causal_lm``'s ``kwargs``); a LoRA checkpoint's adapter
    merged into its base (the checkpoint's own base weights, else the adapter's base model)."""
    from posttrain.models.loading import load_causal_lm  # lazy: config/ imports lora.py without torch

    if not is_adapter_dir(path):
        return load_causal_lm(path, **kwargs)
    return load_adapter(load_causal_lm(adapter_base(path), **kwargs), path, trainable=False).merge_and_unload()


def read_adapter_config(config_path: Path) -> dict:
    """An adapter's ``adapter_config.json``; ConfigError naming it when it is not a JSON object."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                          f"restore the adapter's config") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{config_path}: not valid JSON (not UTF-8: {err.reason} at byte {err.start}); restore "
                          f"the adapter's config") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object, found {type(config).__name__}; restore the "
                          f"adapter's config")
    return config


def check_adapter_files(path: Path) -> None:
    """``--merge-lora``: the adapter's config is JSON, and its weights file holds LoRA tensors only for
    the modules the config targets (PEFT would drop the others without a word: nothing merged)."""
    config_path = Path(path) / ADAPTER_CONFIG
    config = read_adapter_config(config_path)
    weights = Path(path) / "adapter_model.safetensors"
    wanted = config.get("target_modules")
    if not weights.is_file() or not isinstance(wanted, list):
        return
    from safetensors import safe_open  # lazy: config/ imports lora.py without torch

    with safe_open(str(weights), framework="pt") as f:
        held = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in f.keys() if ".lora_" in k}
    if held - set(wanted):
        raise ConfigError(f"{config_path}: target_modules {wanted} but {weights.name} holds LoRA weights for "
                          f"{sorted(held - set(wanted))}, which would not be merged; restore the adapter's config")


def merge_to_hf(load_dir: str | Path, out_dir: str | Path, *, force: bool = False, log=print) -> Path:
    """``posttrain convert --merge-lora``: the LoRA checkpoint (or adapter directory) ``load_dir``
    merged into its base, written as a plain HF model directory ``out_dir`` (staged, then renamed)."""
    from posttrain.checkpoint import save_hf_weights  # lazy: config/ imports lora.py without torch
    from posttrain.models.loading import resolve_model_dir
    from posttrain.models.mcore.convert import _publish_dir, _staging, check_hf_target
    from posttrain.models.mcore.hf_files import copy_tokenizer

    path = resolve_model_dir(load_dir) if not is_adapter_dir(load_dir) else Path(load_dir)
    if not is_adapter_dir(path):
        raise ConfigError(f"--merge-lora: {path} holds no LoRA adapter ({ADAPTER_CONFIG}); give a LoRA run's save "
                          f"directory or checkpoint")
    check_adapter_files(path)
    out_dir = Path(out_dir)
    check_hf_target(out_dir, force)
    base = adapter_base(path)
    merged = load_merged(path, dtype="float32")
    with _staging(out_dir.parent, out_dir.name, out_dir) as tmp:
        save_hf_weights(merged, tmp)
        copy_tokenizer(path if (path / "tokenizer_config.json").is_file() else base, tmp)
        card = path / "README.md"  # the adapter's model card, for the merged model
        if card.is_file():
            text = card.read_text().replace("library_name: peft", "library_name: transformers", 1)
            (tmp / "README.md").write_text(text + f"\nMerged into its base `{base}` by `posttrain convert --merge-lora` "
                                                  f"from `{path}`.\n")
        _publish_dir(tmp, out_dir)
    log(f"wrote {out_dir}: {path}'s LoRA adapter merged into {base}")
    return out_dir
