"""Remove padding (``rl_config.use_remove_padding``): run the model on the valid tokens only.

The padded layout of :mod:`posttrain.train.forward` (``[B, P + R]``, prompts left-padded,
responses right-padded) wastes the matmuls of every padding token. Here the valid tokens of a
micro-batch are concatenated into one row ``[1, N]`` (``N = sum(attention_mask)``), with position
ids that restart at 0 for every sequence, and:

* the linear layers (QKV, output, MLP) run on ``N`` tokens instead of ``B * (P + R)``;
* attention never crosses sequences: the ``posttrain_packed`` attention function (registered in
  Hugging Face's ``AttentionInterface``) gathers each sequence's queries/keys/values back into a
  ``[B, H, L_max, D]`` block and runs one causal SDPA with a key-padding mask, i.e. a
  block-diagonal causal mask over the packed row, without ever building the ``N x N`` mask; a model
  loaded with ``flash_attention_2`` uses the varlen kernel instead (it reads the restarts of the
  position ids);
* logits are computed only at the ``K`` positions that predict a response token
  (``logits_to_keep`` as an index tensor), then scattered back to ``[B, R]``.

The result equals the padded path (up to float rounding); ``tests/unit/perf`` checks it.
Activation checkpointing works: the packing tensors travel as keyword arguments of every layer.

:func:`enable` installs the attention function on a model once (other forwards, such as rollout
with a KV cache, are passed on unchanged to the model's SDPA attention); :func:`packing` is the
switch the training engine turns on around its forwards, and
:func:`packed_response_logprobs` is called by :func:`posttrain.train.forward.response_logprobs`
while it is on.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.errors import ConfigError

ATTN_NAME = "posttrain_packed"
_ACTIVE = contextvars.ContextVar("posttrain_remove_padding", default=False)
_IN_FORWARD = contextvars.ContextVar("posttrain_packed_forward", default=False)


def active() -> bool:
    """Whether response log-probs should take the packed path (set by :func:`packing`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def packing(on: bool = True):
    """Turn the packed path on (or off) for the forwards inside the ``with`` block."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# ---- the attention function --------------------------------------------------------------------
def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``query [1, H, N, D]``, ``key/value [1, H_kv, N, D]`` -> ``[1, N, H, D]``, per-sequence causal.

    ``posttrain_pad_index [B, L]`` holds, for slot ``l`` of sequence ``b``, its packed position
    (clamped for padding slots) and ``posttrain_valid [B, L]`` which slots are real (a prefix of
    each row), so a padded query only sees keys of its own sequence.
    """
    index = kwargs.get("posttrain_pad_index")
    if index is None:  # not a packed forward (rollout, padded batches): the model's own attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    valid = kwargs["posttrain_valid"]
    rows, width = index.shape

    def gather(x):  # [1, h, N, D] -> [B, h, L, D]
        return x[0][:, index].permute(1, 0, 2, 3)

    q, k, v = gather(query), gather(key), gather(value)
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    mask = causal[None, None] & valid[:, None, None, :]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2)[valid].unsqueeze(0), None  # [B, L, H, D] -> [1, N, H, D]


def _mask_fn(*args, **kwargs):
    """Mask builder for ``posttrain_packed``: none inside a packed forward, else the SDPA one."""
    if _IN_FORWARD.get():
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _packed_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask_fn)


def _config(model: torch.nn.Module):
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError("rl_config.use_remove_padding needs a Hugging Face model (with a config); "
                          "set use_remove_padding: false for this model.")
    return config


def enable(model: torch.nn.Module) -> None:
    """Install the packed attention on ``model`` (idempotent). Flash-attention models keep their
    kernel (it handles packed rows natively); eager/SDPA models switch to ``posttrain_packed``,
    which runs SDPA for every forward that is not packed."""
    config = _config(model)
    impl = config._attn_implementation
    if impl == ATTN_NAME or (impl or "").startswith("flash_attention"):
        return
    _register()
    config._attn_implementation = ATTN_NAME


# ---- packing a batch ---------------------------------------------------------------------------
def pack(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed row and its index tensors, from the padded layout of ``forward.py``.

    Returns ``input_ids [1, N]``, ``position_ids [1, N]`` (restarting per sequence),
    ``pad_index``/``valid [B, L_max]`` (for attention), ``keep [K]`` (packed positions whose
    logits predict a response token), ``labels [K]`` and ``select [B, R]`` (where those ``K``
    values go in the ``[B, R]`` output).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    num_resp = batch["response_mask"].shape[1]
    positions = batch.get("position_ids")
    if positions is None:
        positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
    flat = attn.reshape(-1).long().cumsum(0).reshape(attn.shape) - 1  # packed position of each token
    lengths = attn.sum(-1)
    width = int(lengths.max())
    slots = torch.arange(width, device=ids.device)
    valid = slots[None, :] < lengths[:, None]
    starts = lengths.cumsum(0) - lengths
    pad_index = (starts[:, None] + slots[None, :]).clamp(max=max(int(lengths.sum()) - 1, 0))
    select = batch["response_mask"].bool() & attn[:, -num_resp:]
    keep = flat[:, -num_resp - 1 : -1][select]
    return {"input_ids": ids[attn][None], "position_ids": positions[attn][None], "pad_index": pad_index,
            "valid": valid, "keep": keep, "labels": ids[:, -num_resp:][select], "select": select}


def _packed_logits(model: torch.nn.Module, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``[K, V]`` at the ``keep`` positions of the packed row."""
    enable(model)
    token = _IN_FORWARD.set(True)
    try:
        output = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=None,
                       logits_to_keep=packed["keep"], use_cache=False,
                       posttrain_pad_index=packed["pad_index"], posttrain_valid=packed["valid"])
    finally:
        _IN_FORWARD.reset(token)
    logits = output.logits if hasattr(output, "logits") else output
    return logits[0]


def packed_response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`posttrain.train.forward.response_logprobs`, on the packed row."""
    temperature = temperature if temperature > 0 else 1.0
    packed = pack(batch)
    logits = _packed_logits(model, packed)
    select = packed["select"]
    logprobs = logits.new_zeros(select.shape, dtype=torch.float32)
    token_lp = logprobs_from_logits(logits[None], packed["labels"][None], temperature)[0].float()
    logprobs = logprobs.masked_scatter(select, token_lp)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits[None], temperature)[0].float()
            entropy = logits.new_zeros(select.shape, dtype=torch.float32).masked_scatter(select, ent)
    return logprobs, entropy
