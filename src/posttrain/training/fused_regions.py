"""Inductor-compiled elementwise regions of a decoder layer, installed on a model for a ``with`` block.

A decoder layer of a Llama-family model (Llama, Qwen2, Qwen3, Mistral) spends its non-matmul time in
short chains of elementwise ops that eager PyTorch runs one kernel at a time, each reading and
writing every activation: the RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``: five kernels forward,
more backward) and the MLP's ``silu(gate) * up`` (two forward, four backward). ``torch.compile``
(TorchInductor's CPU backend) fuses each chain into one loop. Only these regions are compiled, not
the model: the linear layers keep their kernel (:mod:`posttrain.models.cpu_linear`), the attention
keeps posttrain's packed SDPA blocks, and a region is a few lines of tensor code that compiles
once per process, forward and backward (``dynamic=True``: the packed token count changes every
micro-batch without recompiling; about 18 s of CPU time for both regions with a cold cache on our
2-core EPYC; Inductor's on-disk cache serves later processes).

:func:`fused_regions` swaps the ``forward`` of each RMSNorm and MLP module of the known classes
(:data:`RMS_NORMS`, :data:`MLPS`, whose eager forward is exactly the formula here) for the compiled
one, and restores the eager forward when the block exits; other modules are left as they are.
``benchmarks/update_compile.py`` measures whether the compiled regions pay for themselves, and
``tests/unit/train/test_fused_regions.py`` checks that they equal the eager path within 1e-5 in
fp32 (forward, backward and an optimizer step) and that leaving the block restores it.

Two more regions: ``rotary``, the attention's ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q)
* sin`` and the same for ``k``: a slice, a negation, a cat and three elementwise ops each, fused into
one loop). Hugging Face's attention calls it as a global of its modeling module, so the block
replaces that global (for every model of the class, in the thread that entered the block, while the
block lasts; an asynchronous rollout's thread keeps the eager function) in the modules of the known
attention classes (:data:`ATTENTIONS`) found in ``model``. And ``logprob``, the
LM head's log-softmax-gather (:mod:`posttrain.training.compiled_logprob`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

import torch

from posttrain.training import compiled_logprob

RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")  # w * (x * rsqrt(mean x^2 + eps))
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")  # down(act(gate(x)) * up(x))
ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")  # apply_rotary_pos_emb
REGIONS = ("rms_norm", "silu_mul", "rotary", "logprob")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: normalised in float32, scaled by ``weight`` in the input's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated MLP's activation."""
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``): ``q [B, h, T, D]``, ``cos, sin [B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@functools.lru_cache(maxsize=None)
def compiled(name: str):
    """The compiled region ``name`` (``rms_norm``, ``silu_mul`` or ``rotary``), compiled once per process on its
    first call."""
    # one compile thread: a region is a few kernels, and Inductor's pool of worker processes costs more to start
    return torch.compile({"rms_norm": rms_norm, "silu_mul": silu_mul, "rotary": rotary}[name], dynamic=True,
                         options={"compile_threads": 1})


def _compiled_rotary(eager):
    owner = threading.get_ident()  # another thread (an asynchronous rollout's) keeps the eager function

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or threading.get_ident() != owner:  # not the layout or the thread of the region
            return eager(q, k, cos, sin, unsqueeze_dim)
        return compiled("rotary")(q, k, cos, sin)
    apply_rotary_pos_emb.eager = eager
    return apply_rotary_pos_emb


def _norm_forward(module: torch.nn.Module):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return compiled("rms_norm")(hidden_states, module.weight, module.variance_epsilon)
    return forward


def _mlp_forward(module: torch.nn.Module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(compiled("silu_mul")(module.gate_proj(x), module.up_proj(x)))
    return forward


def _is_silu(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def regions(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The modules of ``model`` whose forward a compiled region replaces, by region."""
    found: dict[str, list[torch.nn.Module]] = {"rms_norm": [], "silu_mul": [], "rotary": []}
    for module in model.modules():
        name = type(module).__name__
        if name in RMS_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor):
            found["rms_norm"].append(module)
        elif name in MLPS and _is_silu(module):
            found["silu_mul"].append(module)
        elif name in ATTENTIONS and callable(getattr(sys.modules.get(type(module).__module__),
                                                     "apply_rotary_pos_emb", None)):
            found["rotary"].append(module)
    return found


def _swap_rotary(attentions: list[torch.nn.Module]) -> list:
    """Replace ``apply_rotary_pos_emb`` in the modeling modules of ``attentions``; the modules replaced."""
    patched = []
    for source in {sys.modules[type(m).__module__] for m in attentions}:
        if not hasattr(source.apply_rotary_pos_emb, "eager"):  # not already replaced by an enclosing block
            source.apply_rotary_pos_emb = _compiled_rotary(source.apply_rotary_pos_emb)
            patched.append(source)
    return patched


def _swap_forwards(model: torch.nn.Module, names: tuple[str, ...]) -> tuple[list, list, int]:
    """Install the regions ``names`` on ``model``: (modules whose forward was swapped, modeling modules whose
    rotary was replaced, how many modules compute through a region)."""
    swapped, count = [], 0
    found = regions(model)
    for region in ("rms_norm", "silu_mul"):
        if region in names:
            make = _norm_forward if region == "rms_norm" else _mlp_forward
            for module in found[region]:
                if "forward" not in module.__dict__:  # not already swapped by an enclosing block
                    module.forward = make(module)
                    swapped.append(module)
    count = len(swapped)
    patched = _swap_rotary(found["rotary"]) if "rotary" in names else []
    if patched:
        count += sum(sys.modules[type(m).__module__] in patched for m in found["rotary"])
    return swapped, patched, count


@contextlib.contextmanager
def fused_regions(model: torch.nn.Module, enabled: bool = True,
                  names: tuple[str, ...] = REGIONS) -> Iterator[int]:
    """Inside, ``model``'s RMSNorms, gated MLPs, rotary embeddings and LM-head log-probs compute through
    their compiled regions ``names`` (when ``enabled``); yields how many modules were swapped (the LM
    head's region counts one). The eager forwards return on exit."""
    unknown = set(names) - set(REGIONS)
    if unknown:
        raise ValueError(f"unknown compiled regions {sorted(unknown)}; known: {', '.join(REGIONS)}")
    swapped, patched, count = _swap_forwards(model, names) if enabled else ([], [], 0)
    logprob = enabled and "logprob" in names and not compiled_logprob.active()
    try:
        with compiled_logprob.logprob_region() if logprob else contextlib.nullcontext():
            yield count + logprob
    finally:
        for module in swapped:
            del module.forward
        for source in patched:
            source.apply_rotary_pos_emb = source.apply_rotary_pos_emb.eager
