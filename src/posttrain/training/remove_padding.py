"""Remove padding (``rl_config.use_remove_padding``): run the model on the valid tokens only.

The padded layout of :mod:`posttrain.training.forward` (``[B, P + R]``, prompts left-padded,
responses right-padded) wastes the matmuls of every padding token. Here the valid tokens of a
micro-batch are concatenated into one row ``[1, N]`` (``N = sum(attention_mask)``), with position
ids that restart at 0 for every sequence, and:

* the linear layers (QKV, output, MLP) run on ``N`` tokens instead of ``B * (P + R)``;
* attention never crosses sequences: the ``posttrain_packed`` attention function (registered in
  Hugging Face's ``AttentionInterface``) gathers each sequence's queries/keys/values back into
  ``[B_k, H, L_k, D]`` blocks and runs one causal SDPA with a key-padding mask per block, i.e. a
  block-diagonal causal mask over the packed row, without ever building the ``N x N`` mask (on a
  CPU: ``is_causal`` with no mask, GQA inside SDPA, bf16 in fp32 without AMX; see
  :mod:`posttrain.models.cpu_attention`). The
  rows go into up to 4 blocks of similar length (:func:`block_rows`), so the many short answers of
  an RL batch are not padded to its longest one (the attention costs ``rows x width^2``); a model
  loaded with ``flash_attention_2`` uses the varlen kernel instead (it reads the restarts of the
  position ids);
* logits are computed only at the ``K`` positions that predict a response token
  (``logits_to_keep`` as an index tensor), then scattered back to ``[B, R]``;
* **shared prefixes** (``rl_config.share_prompt_prefix``, on by default): every prefix that several
  rows have in common, in tokens and positions, goes into the packed row **once**: a group's prompt
  (the ``n`` samples of a GRPO group), a system prompt or instruction that every prompt starts
  with, and the first tokens that several answers of a group begin with (an answer repeated exactly
  adds nothing). ``pack`` sorts the rows by their sequences and takes from each row's predecessor the
  prefix they share (a prefix tree of the rows); a row's attention block gathers the shared
  positions' keys/values, so each token attends to its own sequence as before, and autograd sums
  the gradients that every row sends back into a shared position. Under causal attention the hidden
  state at a position depends only on the tokens up to it, so computing a shared prefix once is
  exact; the linear layers run on the distinct prefixes only. On the chat workload (8 prompts of ~54
  tokens, 27 of them a common system prompt, 8 answers of ~12 tokens each) that is 688 tokens
  where one copy per group's prompt took 1,246 and no sharing 4,298. The LM head runs once per
  distinct (position, next token) pair. The attention runs each packed position's query once too:
  the row that first has it runs it, the other rows in suffix blocks whose queries are their own
  slots only (``pack``'s ``query_start``), so a group's attention costs ``P^2 + n R (P + R)`` rather
  than ``n (P + R)^2``. The flash-attention varlen path does not share (its sequences must be
  contiguous).

The result equals the padded path (up to float rounding); ``tests/unit/train/test_remove_padding.py`` checks it.
Activation checkpointing works: the packing tensors travel as keyword arguments of every layer.

:func:`enable` installs the attention function on a model once (other forwards, such as rollout
with a KV cache, are passed on unchanged to the model's SDPA attention). The training engine
turns the packed path on explicitly: its ``EngineOptions.use_remove_padding`` becomes a
:class:`Packing` passed to the loss function and to
:func:`posttrain.training.forward.response_logprobs`, which then calls :func:`packed_response_logprobs`.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.algo.truncation import Truncation
from posttrain.errors import ConfigError
from posttrain.models import cpu_attention
from posttrain.training.batch import default_position_ids
from posttrain.training.lm_head import detached_head, head_logprobs
from posttrain.training.multimodal import model_kwargs, pack_image_features

ATTN_NAME = "posttrain_packed"
# set only while _packed_logits runs the model, so the attention function knows a packed forward
_IN_FORWARD = contextvars.ContextVar("posttrain_packed_forward", default=False)


@dataclass(frozen=True)
class Packing:
    """The packed path is on; ``share_prompts``: a prefix that several rows have in common is packed once."""

    share_prompts: bool = True


# ---- the attention function --------------------------------------------------------------------
def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``query [1, H, N, D]``, ``key/value [1, H_kv, N, D]`` -> ``[1, N, H, D]``, per-sequence causal.

    ``posttrain_blocks`` (:func:`split_blocks`) holds blocks of rows of similar length. A row's slot
    ``l`` is its sequence's ``l``-th token; ``pad_index [B_k, L_k]`` gives each slot's packed position
    (clamped for padding slots, which are a suffix of the row). A full block ``(pad_index, valid)`` runs
    every slot of its rows as a query (``valid [B_k, L_k]``: the real slots); a suffix block
    ``(pad_index, valid, query_index [B_k, Q_k], mask)`` runs only the queries ``query_index`` gives,
    the slots from a row's first response token on (a shared prompt's later samples, whose prompt
    queries the group's first row runs once), with ``mask [B_k, 1, Q_k, L_k]`` causal by slot and
    hiding padding keys. ``posttrain_owner [N]`` says which query of
    the blocks' outputs, laid end to end, gives each packed position its output.
    """
    blocks = kwargs.get("posttrain_blocks")
    if blocks is None:  # not a packed forward (rollout, padded batches): SDPA, as decode_sdpa runs it
        return cpu_attention.decode_sdpa(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, **kwargs)
    p = dropout if module.training else 0.0
    outs = [_block_attention(module, query, key, value, p, scaling, *block) for block in blocks]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, kwargs["posttrain_owner"]).unsqueeze(0), None  # [1, N, H, D]


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[1, h, N, D]`` -> ``[B, h, L, D]`` at the packed positions ``index [B, L]``, by whole rows of
    ``[N, h, D]`` (the projections' layout): index_select's backward (index_add_) is 7x faster on a
    CPU than advanced indexing's (index_put_)."""
    rows, width = index.shape
    heads, dim = x.shape[1], x.shape[-1]
    return x[0].transpose(0, 1).index_select(0, index.reshape(-1)).view(rows, width, heads, dim).permute(0, 2, 1, 3)


def _block_attention(module, query, key, value, dropout, scaling, index, valid, query_index=None, mask=None):
    """One block's causal SDPA: ``[B_k * Q_k, H, D]`` (``Q_k = L_k`` for a full block)."""
    q = _gather(query, index if query_index is None else query_index)
    k, v = _gather(key, index), _gather(value, index)
    if cpu_attention.enabled(query.device):  # GQA in SDPA, bf16 in fp32 without AMX (exact: see there)
        out = cpu_attention.causal_block_sdpa(q, k, v, dropout, scaling, mask)
    else:
        if mask is None:  # a full block: causal and key padding
            causal = torch.ones(k.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            mask = causal[None, None] & valid[:, None, None, :]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling)
    rows, heads, width, dim = out.shape
    return out.transpose(1, 2).reshape(rows * width, heads, dim)  # [B, H, L, D] -> [B * L, H, D]


MAX_BLOCKS = 4  # attention blocks of rows of similar length per packed forward
_CANDIDATES = 32  # block boundaries considered (rows sorted by length, in groups of about equal count)


def block_rows(lengths: list[int], max_blocks: int = MAX_BLOCKS, queries: list[int] | None = None) -> list[list[int]]:
    """Rows (indices into ``lengths``) in at most ``max_blocks`` blocks of similar length, chosen to
    least ``sum(rows_k * width_k * queries_k)`` (a block's attention cost: its rows padded to its
    longest, ``queries_k`` its most query slots; ``queries`` defaults to ``lengths``: a row's every
    slot is a query).

    One RL micro-batch holds many short answers and a few long ones; padding every row to the
    longest costs the attention that square for all of them."""
    queries = lengths if queries is None else queries
    order = sorted(range(len(lengths)), key=lambda r: (lengths[r], queries[r]))
    step = -(-len(order) // _CANDIDATES)
    ends = list(range(step, len(order), step)) + [len(order)]  # candidate block ends (exclusive)
    width = [lengths[order[e - 1]] for e in ends]
    inf = float("inf")

    most = [max(queries[r] for r in order[start:end]) for start, end in zip([0, *ends], ends)]  # per candidate
    top = {(i, j): max(most[i + 1:j + 1]) for j in range(len(ends)) for i in range(-1, j)}

    def cost(i: int, j: int) -> int:  # rows order[ends[i]:ends[j]] (i = -1: from the first) as one block
        return (ends[j] - (ends[i] if i >= 0 else 0)) * width[j] * top[i, j]

    best = [[inf] * len(ends) for _ in range(max_blocks)]  # best[k][j]: rows[:ends[j]] in k + 1 blocks
    cut: list[list[int]] = [[-1] * len(ends) for _ in range(max_blocks)]
    for j in range(len(ends)):
        best[0][j] = cost(-1, j)
    for k in range(1, max_blocks):
        for j in range(len(ends)):
            for i in range(j):
                total = best[k - 1][i] + cost(i, j)
                if total < best[k][j]:
                    best[k][j], cut[k][j] = total, i
    least = min(best[b][-1] for b in range(max_blocks))
    k = next(b for b in range(max_blocks) if best[b][-1] <= 1.1 * least)  # another block only for > 10%
    blocks, j = [], len(ends) - 1
    while k >= 0:
        start = ends[cut[k][j]] if k else 0
        blocks.append(order[start:ends[j]])
        j, k = cut[k][j], k - 1
    return blocks[::-1]


def split_blocks(packed: dict[str, torch.Tensor]) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """``pack``'s one block of all rows (``pad_index``/``valid [B, L]``, ``owner`` into ``B * L``
    slots, ``query_start [B]``) as the attention's blocks (see :func:`_packed_attention`): rows whose
    every slot is a query (``query_start`` 0) in :func:`block_rows`' full blocks, each trimmed to its
    longest row; rows whose queries start later (a shared prompt's later samples) in suffix blocks;
    and ``owner`` pointing into the blocks' queries laid end to end."""
    index, valid, owner = packed["pad_index"], packed["valid"], packed["owner"]
    rows, width = index.shape
    lengths = valid.sum(-1).tolist()
    first = packed["query_start"].tolist()
    blocks, base = [], [0] * rows
    offset = 0
    for suffix in (False, True):
        # a row all of whose slots are an earlier row's (a repeated answer) runs no query
        members_of = [b for b in range(rows) if (first[b] > 0) == suffix and first[b] < lengths[b]]
        if not members_of:
            continue
        sub = block_rows([lengths[b] for b in members_of],
                         queries=[lengths[b] - first[b] for b in members_of] if suffix else None)
        for group in sub:
            members = [members_of[i] for i in group]
            widest = max(1, max(lengths[b] for b in members))
            pick = torch.tensor(members, device=index.device)
            block = (index.index_select(0, pick)[:, :widest], valid.index_select(0, pick)[:, :widest])
            span = widest
            if suffix:
                span = max(1, max(lengths[b] - first[b] for b in members))
                start = torch.tensor([first[b] for b in members], device=index.device)[:, None]
                slot = start + torch.arange(span, device=index.device)[None, :]  # [B_k, Q_k] query slots
                causal = torch.arange(widest, device=index.device)[None, None, :] <= slot[:, :, None]
                block += (block[0].gather(1, slot.clamp(max=widest - 1)), (causal & block[1][:, None, :])[:, None])
            for j, b in enumerate(members):
                base[b] = offset + j * span - first[b]
            offset += len(members) * span
            blocks.append(block)
    base_t = torch.tensor(base, device=owner.device)
    return blocks, base_t[owner // width] + owner % width


def _mask_fn(*args, **kwargs):
    """Mask builder for ``posttrain_packed``: none inside a packed forward, else the SDPA one."""
    if _IN_FORWARD.get():
        return None

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, _packed_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask_fn)


def _config(model: torch.nn.Module):
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError("rl_config.use_remove_padding needs a Hugging Face model (with a config); "
                          "set use_remove_padding: false for this model.")
    return config


def enable(model: torch.nn.Module) -> bool:
    """Install the packed attention on ``model`` (idempotent); True when it is posttrain's.
    Flash-attention models keep their kernel (it handles packed rows natively); eager/SDPA models
    switch to ``posttrain_packed``, which runs SDPA for every forward that is not packed."""
    config = _config(model)
    impl = config._attn_implementation
    if (impl or "").startswith("flash_attention"):
        return False
    if impl != ATTN_NAME:
        _register()
        config._attn_implementation = ATTN_NAME
    return True


# ---- packing a batch ---------------------------------------------------------------------------
def pack(batch: dict[str, torch.Tensor], share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """The packed row and its index tensors, from the padded layout of ``forward.py``.

    Returns ``input_ids [1, N]``, ``position_ids [1, N]`` (restarting per sequence; a response
    continues its prompt's positions; ``[A, 1, N]`` from multi-axis positions ``[A, B, T]``), ``order [N]`` (the
    flat padded token of each packed position), ``pad_index``/``valid [B, L_max]`` (for attention: slot
    ``l`` of row ``b`` is its sequence's ``l``-th real token, at packed position ``pad_index[b, l]``),
    ``owner [N]`` (the block slot that computes each packed position), ``query_start [B]`` (a row's
    first slot whose output it computes: the slots before it are an earlier row's), ``keep [K]`` and
    ``labels [K]`` (the distinct pairs of a packed position whose logits predict a response token and
    that token), and ``pick [M]`` and ``select [B, R]`` (the pair of each of the ``M`` response tokens,
    and where those go in the ``[B, R]`` output). With ``share_prompts`` every prefix that several rows
    have in common, in tokens and positions, is packed once (see the module docstring).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    rows, num_resp = ids.shape[0], batch["response_mask"].shape[1]
    prompt_width, row_width = ids.shape[1] - num_resp, ids.shape[1]
    device = ids.device
    positions = _positions(batch)
    plen_t = attn[:, :prompt_width].sum(-1, keepdim=True)
    lengths = (plen_t + attn[:, prompt_width:].sum(-1, keepdim=True))[:, 0]
    width = max(int(lengths.max()), 1)
    slots = torch.arange(width, device=device)[None, :]
    valid = slots < lengths[:, None]
    # the flat padded token at each slot: prompts are left-padded, responses right-padded
    first = torch.arange(rows, device=device)[:, None] * row_width + prompt_width
    source = torch.where(slots < plen_t, first - plen_t + slots, first + slots - plen_t).masked_fill(~valid, 0)
    shared = _shared_prefixes(ids.reshape(-1)[source], positions, source, valid, lengths) \
        if share_prompts and positions.ndim == 2 else None
    pad_index, query_start, packed = _packed_positions(lengths.tolist(), shared, device)

    creates = valid & (slots >= query_start[:, None])  # the slots whose packed position a row computes
    order = torch.empty(packed, dtype=torch.long, device=device)
    owner = torch.empty(packed, dtype=torch.long, device=device)
    order[pad_index[creates]] = source[creates]  # packed position -> flat padded token
    owner[pad_index[creates]] = (torch.arange(rows, device=device)[:, None] * width + slots)[creates]

    select = batch["response_mask"].bool() & attn[:, prompt_width:]
    # response token t of row b is predicted at the row's previous slot: its prompt's last one for t = 0
    predictor = pad_index.gather(1, (plen_t - 1 + torch.arange(num_resp, device=device)[None, :]).clamp(max=width - 1))
    pairs = torch.stack([predictor[select], ids[:, prompt_width:][select]])
    (keep, labels), pick = torch.unique(pairs, dim=1, return_inverse=True) if pairs.numel() else (pairs, pairs[0])
    # multi-axis positions [A, B, T] (a vision-language model's, multimodal.py) are packed per axis: [A, 1, N]
    packed_positions = positions.reshape(-1)[order][None] if positions.ndim == 2 else \
        positions.reshape(positions.shape[0], -1)[:, order][:, None]
    return {"input_ids": ids.reshape(-1)[order][None], "position_ids": packed_positions, "order": order,
            "pad_index": pad_index.clamp(min=0), "valid": valid, "owner": owner,
            "query_start": query_start, "keep": keep, "labels": labels, "pick": pick, "select": select}


def _shared_prefixes(tokens: torch.Tensor, positions: torch.Tensor, source: torch.Tensor, valid: torch.Tensor,
                     lengths: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """The rows in lexicographic order of their (token, position) sequences, each row's predecessor in
    that order and the length of the prefix they share. A row's longest common prefix with any row
    before it in that order is the one with its predecessor, so taking each row's shared slots from
    its predecessor packs every common prefix once (a prefix tree of the rows)."""
    key = (tokens << 32 | positions.reshape(-1)[source]).masked_fill(~valid, -1)
    seqs = [row[:n] for row, n in zip(key.tolist(), lengths.tolist())]
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    sorted_key = key[order]
    same = (sorted_key[1:] == sorted_key[:-1]) & valid[order][1:] & valid[order][:-1]
    common = same.long().cumprod(1).sum(1).tolist()
    return order, [-1] + order[:-1], [0] + common


def _packed_positions(lengths: list[int], shared, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each row's packed position per slot ``[B, L]`` (-1 past its end), its first slot of its own
    (``query_start [B]``) and the packed length: rows in ``shared``'s order, each after taking the
    prefix it shares from its predecessor (none without ``shared``)."""
    rows, width = len(lengths), max(max(lengths, default=1), 1)
    order, previous, common = shared if shared is not None else (range(rows), [-1] * rows, [0] * rows)
    pad_index = torch.full((rows, width), -1, dtype=torch.long, device=device)
    start, packed = [0] * rows, 0
    for row, before, k in zip(order, previous, common):
        if k:
            pad_index[row, :k] = pad_index[before, :k]
        new = lengths[row] - k
        pad_index[row, k:lengths[row]] = torch.arange(packed, packed + new, device=device)
        start[row], packed = k, packed + new
    return pad_index, torch.tensor(start, device=device), packed


def _positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    positions = batch.get("position_ids")
    if positions is None:
        positions = default_position_ids(batch["attention_mask"])
    return positions


def _prompt_keys(batch: dict[str, torch.Tensor]) -> list[tuple]:
    """One hashable key per row: its prompt's tokens and their positions. Rows with equal keys have
    identical prompt hidden states, so they may share one copy of the prompt."""
    num_prompt = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    real = batch["attention_mask"][:, :num_prompt].bool()
    ids = torch.where(real, batch["input_ids"][:, :num_prompt], -1).tolist()
    pos = torch.where(real, _positions(batch)[:, :num_prompt], -1).tolist()
    return [(tuple(i), tuple(p)) for i, p in zip(ids, pos)]


def group_rows_by_prompt(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A row order in which rows with identical prompts are adjacent (groups in order of first
    appearance, rows in order within a group), so fixed-size micro-batches share prompts."""
    groups: dict[tuple, list[int]] = {}
    for row, key in enumerate(_prompt_keys(batch)):
        groups.setdefault(key, []).append(row)
    return torch.tensor([row for members in groups.values() for row in members], dtype=torch.long)


def _packed_logits(model: torch.nn.Module, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``[K, V]`` at the ``keep`` positions of the packed row (the hidden states ``[K, H]``
    inside :func:`~posttrain.training.lm_head.detached_head`)."""
    blocks, owner = split_blocks(packed)
    token = _IN_FORWARD.set(True)
    try:
        output = model(input_ids=packed["input_ids"], **model_kwargs(packed), position_ids=packed["position_ids"],
                       attention_mask=None,
                       logits_to_keep=packed["keep"], use_cache=False, posttrain_blocks=blocks, posttrain_owner=owner)
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
    share_prompts: bool = True,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`posttrain.training.forward.response_logprobs`, on the packed row."""
    temperature = temperature if temperature > 0 else 1.0
    # sharing needs posttrain's attention; a flash-attention varlen model keeps its own sequences
    share = enable(model) and share_prompts
    packed = pack(batch, share_prompts=share)
    packed.update(pack_image_features(batch, packed["order"]))  # a multimodal batch's (training/multimodal.py)
    with detached_head(model) as head:  # the forward returns hidden states: the head runs in chunks
        out = _packed_logits(model, packed)
    select, labels = packed["select"], packed["labels"]
    if head is not None:
        token_lp, ent = head_logprobs(head, out, labels, temperature, with_entropy=with_entropy,
                                      entropy_grad=entropy_grad, truncation=truncation)
    else:
        token_lp = logprobs_from_logits(out[None], labels[None], temperature, truncation=truncation)[0].float()
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_from_logits(out[None], temperature)[0].float()
    zeros = torch.zeros(select.shape, dtype=torch.float32, device=out.device)
    logprobs = zeros.masked_scatter(select, token_lp[packed["pick"]])
    entropy = zeros.masked_scatter(select, ent[packed["pick"]]) if ent is not None else None
    return logprobs, entropy
