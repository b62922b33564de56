"""Convert between Hugging Face and Megatron-Core checkpoints, one layer at a time.

:func:`hf_to_mcore` writes one rank file after the other, each built layer by layer from the
memory-mapped HF tensors, so the peak memory is about one output shard plus one layer.
:func:`mcore_to_hf` memory-maps the rank files and writes the HF safetensors in shards, one layer
merged at a time. Both write into a temporary directory next to the target and rename it into
place when complete; a failure leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from posttrain.checkpoint.card import converted_card
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.arch import ModelArch, arch_from_hf_config
from posttrain.models.mcore import mapping, mcore_files, rank_checks, splits, targets
from posttrain.models.mcore.hf_files import (TOKENIZER_FILES, HFWeights, ShardedWriter, check_shapes, copy_tokenizer,
                                             read_hf_config)

SUPPORTED = ("qwen2", "qwen3", "llama")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
MG2HF = "mg2hf"


def params_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"--params-dtype {name!r}: use one of fp32, bf16, fp16") from None


# ---- HF -> Megatron-Core ----------------------------------------------------------------------------

def hf_arch(hf_dir: Path, weights: HFWeights, *, orm: bool, moe: bool = False) -> ModelArch:
    """The architecture of an HF directory, checked against what the converter supports; ``moe``:
    a Qwen3-MoE model is accepted too (the megatron backend builds it; the legacy converter does not)."""
    config = read_hf_config(hf_dir / "config.json")
    arch = arch_from_hf_config(hf_dir)
    if arch.num_experts and not moe:
        raise ConfigError(f"{hf_dir}: a mixture-of-experts model ({config.get('model_type')}, {arch.num_experts} "
                          f"experts); posttrain convert writes dense Qwen2/Qwen2.5, Qwen3 and Llama models in the "
                          f"legacy layout. A Qwen3-MoE model trains on the megatron backend from its HF directory, "
                          f"and its torch_dist checkpoints convert back to HF")
    if arch.num_experts:
        check_moe_config(hf_dir, config)
    elif arch.model_type not in SUPPORTED:
        raise ConfigError(f"{hf_dir}/config.json: model_type {arch.model_type!r} is not supported; "
                          f"posttrain convert handles {', '.join(SUPPORTED)} (Qwen2/Qwen2.5, Qwen3, Llama/SmolLM2)")
    is_rm = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    if orm and not (is_rm and mapping.HF_SCORE in weights):
        raise ConfigError(f"{hf_dir}: --orm converts a sequence-classification (reward) model with a "
                          f"'score' head, but this is {config.get('architectures')}")
    if orm and weights.shape(mapping.HF_SCORE)[0] != 1:
        raise ConfigError(f"{hf_dir}: the reward head has {weights.shape(mapping.HF_SCORE)[0]} outputs; "
                          f"--orm converts a scalar (num_labels = 1) head")
    if is_rm and not orm:
        raise ConfigError(f"{hf_dir} is a sequence-classification (reward) model: add --orm to convert "
                          f"its backbone and scalar head")
    return replace(arch, qkv_bias=hf_has(weights, "self_attn.q_proj.bias"),
                   qk_norm=hf_has(weights, "self_attn.q_norm.weight"))


def check_moe_config(hf_dir: Path, config: dict) -> None:
    """Refuse the mixture-of-experts models the mapping does not cover: Qwen3-MoE with experts in
    every layer and no shared expert is what it maps."""
    where = hf_dir / "config.json"
    if config.get("model_type") != "qwen3_moe":
        raise ConfigError(f"{where}: model_type {config.get('model_type')!r}: of the mixture-of-experts models, "
                          f"the Hugging Face <-> Megatron-Core mapping covers qwen3_moe (Qwen3-MoE) only")
    if int(config.get("decoder_sparse_step") or 1) != 1 or config.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step={config.get('decoder_sparse_step')}, mlp_only_layers="
                          f"{config.get('mlp_only_layers')}: the mapping covers models with experts in every layer "
                          f"(decoder_sparse_step 1, no mlp_only_layers)")


def hf_has(weights: HFWeights, layer_param: str) -> bool:
    return mapping.hf_layer_name(0, layer_param) in weights


def hf_to_mcore(load_dir: str | Path, save_dir: str | Path, *, tp: int = 1, pp: int = 1,
                num_layer_list: str | None = None, layers_per_virtual_stage: int | None = None,
                dtype: str | None = None, orm: bool = False, add_qkv_bias: bool | None = None,
                divisor: int = 128, force: bool = False, log=print) -> Path:
    """Write ``save_dir/release/mp_rank_*`` and the tracker; returns the ``release`` dir."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    splits.check_sizes(tp=tp, pp=pp, layers_per_virtual_stage=layers_per_virtual_stage, divisor=divisor)
    if not (load_dir / "config.json").is_file():
        raise ConfigError(f"--load-dir {load_dir}: no config.json; give a Hugging Face model directory")
    if save_dir.resolve() == load_dir.resolve():
        raise ConfigError(f"--save-dir {save_dir} is the --load-dir: the HF directory would then also hold a "
                          f"Megatron checkpoint (release/ and the tracker) and load as one; give another --save-dir")
    read_hf_config(load_dir / "config.json")
    weights = HFWeights(load_dir)
    arch = hf_arch(load_dir, weights, orm=orm)
    check_shapes(load_dir, weights)
    if add_qkv_bias and not arch.qkv_bias:
        raise ConfigError(f"--add-qkv-bias: {load_dir} has no q/k/v biases (model_type {arch.model_type}); "
                          f"drop the flag")
    if arch.qkv_bias and not add_qkv_bias:
        log(f"note: {load_dir} has q/k/v biases; they are converted (the seed's converter needs --add-qkv-bias)")
    out_dtype = params_dtype(dtype)
    splits.check_tp(tp, heads=arch.num_attention_heads, groups=arch.num_kv_heads, ffn=arch.ffn_hidden_size)
    padded = splits.padded_vocab_size(arch.vocab_size, divisor, tp)
    if layers_per_virtual_stage and pp < 2:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --target-pipeline-parallel-size > 1")
    par = mcore_files.Parallel(tp, pp, 1, mcore_files.pipeline_stages(arch.num_layers, pp, num_layer_list,
                                                            layers_per_virtual_stage))
    first_dtype = weights.rows(mapping.HF_EMBEDDING, 0, 1).dtype
    args = mcore_files.make_args(arch, par, padded_vocab=padded, divisor=divisor,
                            params_dtype=out_dtype or first_dtype, num_layer_list=num_layer_list,
                            layers_per_virtual_stage=layers_per_virtual_stage, orm=orm)
    check_mcore_target(save_dir, force)
    targets.check_free_space(save_dir, _mcore_bytes(weights, arch, padded, out_dtype or first_dtype, pp))
    params = mapping.layer_params(arch)
    with targets.staging(save_dir, "mg", save_dir) as tmp:
        release = tmp / mcore_files.RELEASE
        for pp_rank, tp_rank in _progress([(p, t) for p in range(pp) for t in range(tp)], "rank files"):
            shard: dict[str, Any] = {"checkpoint_version": mcore_files.CHECKPOINT_VERSION, "iteration": 0, "args": args}
            for chunk in range(par.chunks):
                state = _stage_state(weights, arch, par, params, pp_rank, chunk, tp_rank, padded, orm)
                shard[mcore_files.model_key(chunk, par.chunks)] = {
                    k: v.to(out_dtype) if out_dtype else v for k, v in state.items()}
            out = release / mcore_files.rank_dir_name(tp_rank, pp_rank, pp) / mcore_files.RANK_FILE
            out.parent.mkdir(parents=True)
            shard[mcore_files.SLOT_KEY] = {"tp_rank": tp_rank, "pp_rank": pp_rank}
            torch.save(shard, out)
            del shard
        (tmp / mcore_files.TRACKER).write_text(mcore_files.RELEASE + "\n", encoding="utf-8")
        _publish_mcore(tmp, save_dir)
    log(f"wrote {save_dir / mcore_files.RELEASE} (TP {tp}, PP {pp}{f', {par.chunks} virtual stages' if par.chunks > 1 else ''}, "
        f"{arch.model_type}, {arch.num_layers} layers, vocab {arch.vocab_size} padded to {padded})")
    return save_dir / mcore_files.RELEASE


def _stage_state(weights: HFWeights, arch: ModelArch, par: mcore_files.Parallel, params: list[mapping.Param],
                 pp_rank: int, chunk: int, tp_rank: int, padded: int, orm: bool,
                 ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """One rank's state dict for one (virtual) stage, reading only the rows/columns that rank holds
    (of a mixture-of-experts model, the experts of expert-parallel rank ``ep_rank`` of ``par.ep``)."""
    tp = par.tp
    state: dict[str, torch.Tensor] = {}
    if par.is_first(pp_rank, chunk):
        state[mapping.EMBEDDING] = _vocab_shard(weights, mapping.HF_EMBEDDING, arch.vocab_size, padded, tp, tp_rank)
    params = mapping.rank_params(params, arch, par.ep, ep_rank)
    for local, layer in enumerate(par.stages[pp_rank][chunk]):
        for p in params:
            names = [mapping.hf_layer_name(layer, n) for n in p.hf]
            state[mapping.mcore_layer_name(local, p.mcore)] = _param_shard(weights, p, names, arch, tp, tp_rank)
    if par.is_last(pp_rank, chunk):
        state[mapping.FINAL_NORM] = weights.get(mapping.HF_FINAL_NORM).clone()
        if orm:
            hidden = weights.shape(mapping.HF_SCORE)[1]
            state[mapping.RM_HEAD] = weights.cols(mapping.HF_SCORE, *_block(hidden, tp, tp_rank))
        elif not arch.tie_embeddings or par.pp > 1:
            source = mapping.HF_EMBEDDING if arch.tie_embeddings else mapping.HF_LM_HEAD
            state[mapping.OUTPUT_LAYER] = _vocab_shard(weights, source, arch.vocab_size, padded, tp, tp_rank)
    return state


def _block(size: int, tp: int, rank: int) -> tuple[int, int]:
    per = size // tp
    return rank * per, (rank + 1) * per


def _param_shard(weights: HFWeights, p: mapping.Param, names: list[str], arch: ModelArch, tp: int,
                 rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of one layer parameter (the same tensor as
    ``mapping.split_param(p, full tensors, arch, tp)[rank]``, without reading the other ranks' parts)."""
    if p.kind == mapping.REPLICATED:
        return weights.get(names[0]).clone()
    if p.kind == mapping.ROW:
        return weights.cols(names[0], *_block(weights.shape(names[0])[1], tp, rank))
    if p.kind == mapping.COLUMN:
        return weights.rows(names[0], *_block(weights.shape(names[0])[0], tp, rank))
    if p.kind == mapping.FC1:  # gate and up: the dense MLP's or an expert's
        lo, hi = _block(weights.shape(names[0])[0], tp, rank)
        return torch.cat([weights.rows(names[0], lo, hi), weights.rows(names[1], lo, hi)])
    if p.kind == mapping.QKV:  # whole query groups per rank
        g0, g1 = _block(arch.num_kv_heads, tp, rank)
        q_rows = arch.num_attention_heads // arch.num_kv_heads * arch.head_dim
        q = weights.rows(names[0], g0 * q_rows, g1 * q_rows)
        k, v = (weights.rows(n, g0 * arch.head_dim, g1 * arch.head_dim) for n in names[1:])
        return splits.split_qkv(q, k, v, groups=g1 - g0, tp=1)[0]
    raise AssertionError(p.kind)


def _vocab_shard(weights: HFWeights, name: str, vocab: int, padded: int, tp: int, rank: int) -> torch.Tensor:
    """Rows ``[rank * padded / tp, (rank + 1) * padded / tp)`` of the vocabulary, zero rows past ``vocab``."""
    lo, hi = _block(padded, tp, rank)
    rows = weights.rows(name, min(lo, vocab), min(hi, vocab))
    if rows.shape[0] < hi - lo:
        rows = torch.cat([rows, rows.new_zeros(hi - lo - rows.shape[0], *rows.shape[1:])])
    return rows


def _mcore_bytes(weights: HFWeights, arch: ModelArch, padded: int, dtype: torch.dtype, pp: int) -> int:
    """About the bytes hf -> mg writes: every parameter once, the vocabulary padded (twice when the
    output layer is a copy of the embedding)."""
    per = torch.empty((), dtype=dtype).element_size()
    vocab_rows = padded * (1 if arch.tie_embeddings and pp == 1 else 2)
    hf_params = sum(int(torch.Size(weights.shape(n)).numel()) for n in weights.names())
    return per * (hf_params + (vocab_rows - arch.vocab_size * (1 if arch.tie_embeddings else 2)) * arch.hidden_size)


def check_mcore_target(save_dir: Path, force: bool) -> None:
    """Refuse a target whose release/ or tracker convert did not write, or that holds training
    checkpoints (convert's release and tracker would hide them from a resume); ``--force`` replaces
    only a release/ convert wrote (its manifest) and a tracker that says ``release``."""
    if save_dir.exists() and not save_dir.is_dir():
        raise ConfigError(f"--save-dir {save_dir} is an existing file; give a directory")
    if not save_dir.is_dir():
        return
    iters = sorted(p.name for p in save_dir.iterdir() if p.name.startswith("iter_"))
    tracker = save_dir / mcore_files.TRACKER
    said = tracker.read_text(encoding="utf-8", errors="replace").strip()[:40] if tracker.is_file() else None
    if iters or (said is not None and said != mcore_files.RELEASE):
        raise ConfigError(f"--save-dir {save_dir} holds {_describe_saves(save_dir, iters)} ({', '.join(iters[:3]) or 'no iter_*'}"
                          f"{', ...' if len(iters) > 3 else ''}; tracker {said!r}): convert's release/ and tracker "
                          f"would make a resume from it start from the converted weights instead. Give another "
                          f"--save-dir (--force does not override this)")
    release = save_dir / mcore_files.RELEASE
    if not (os.path.lexists(release) or os.path.lexists(tracker)):
        return
    ours = targets.is_converts_release(release)
    what = ("a Megatron checkpoint written by posttrain convert" if ours else
            f"a {'link' if release.is_symlink() else 'file' if release.is_file() else 'directory'} {release} "
            f"that posttrain convert did not write" if os.path.lexists(release) else f"a tracker {tracker}")
    if not force:
        raise ConfigError(f"--save-dir {save_dir} already holds {what}; give an empty or new directory"
                          f"{', or --force to replace its release/ and tracker (nothing else is deleted)' if ours or not os.path.lexists(release) else ''}")
    if os.path.lexists(release) and not ours:
        raise ConfigError(f"--save-dir {save_dir} holds {what} (no {targets.MANIFEST} in it): --force replaces only "
                          f"convert's own output. Move {release} away or give another --save-dir")


def _describe_saves(save_dir: Path, iters: list[str]) -> str:
    from posttrain.checkpoint import is_hf_model_dir  # lazy: torch

    hf = [n for n in iters if is_hf_model_dir(save_dir / n)]
    if hf:
        return "posttrain training checkpoints (HF format)"
    if any(mcore_files.is_mcore_checkpoint(save_dir / n) for n in iters):
        return "Megatron training checkpoints"
    return "training checkpoints (iter_* and a tracker)"


def _publish_mcore(tmp: Path, save_dir: Path) -> None:
    from posttrain.checkpoint import make_readable  # lazy: torch

    staged = tmp / mcore_files.RELEASE
    targets.write_manifest(staged, (str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()))
    make_readable(staged)
    target = save_dir / mcore_files.RELEASE
    if os.path.lexists(target):  # check_mcore_target allowed it: convert's own release/
        target.rename(tmp / "previous-release")
    staged.rename(target)
    os.replace(tmp / mcore_files.TRACKER, save_dir / mcore_files.TRACKER)


# ---- Megatron-Core -> HF ----------------------------------------------------------------------------

class McoreCheckpoint:
    """A Megatron checkpoint's iteration dir: args, split, architecture, and its rank files opened
    lazily (memory-mapped) and checked to belong together."""

    def __init__(self, load_dir: str | Path):
        self.dir = mcore_files.iteration_dir(Path(load_dir))
        self.args = mcore_files.read_args(self.dir)
        self.par = mcore_files.parallel_from_args(self.args, self.dir)
        if self.par.ep > 1 or getattr(self.args, "num_experts", None):
            raise CheckpointError(f"{self.dir}: a mixture-of-experts checkpoint (num_experts "
                                  f"{getattr(self.args, 'num_experts', None)}, EP {self.par.ep}) in the legacy layout; "
                                  f"posttrain converts dense models from it (a megatron-backend run saves MoE models "
                                  f"as torch_dist, which converts back)")
        self.arch = mcore_files.arch_from_args(self.args, self.dir)
        mcore_files.check_vocab_padding(self.args, self.par.tp, self.dir)
        found = mcore_files.rank_dirs(self.dir)
        expected = {(t, p, 0) for t in range(self.par.tp) for p in range(self.par.pp)}
        for key in sorted(expected - set(found)):
            name = mcore_files.rank_dir_name(key[0], key[1], self.par.pp)
            raise CheckpointError(f"{self.dir / name / mcore_files.RANK_FILE} is missing: the checkpoint's args say "
                                  f"TP {self.par.tp} x PP {self.par.pp}, so every rank's shard must be present")
        if set(found) - expected:
            extra = found[sorted(set(found) - expected)[0]].name
            raise CheckpointError(f"{self.dir / extra}: a shard outside the TP {self.par.tp} x PP {self.par.pp} "
                                  f"split its args describe; the directory mixes checkpoints")
        self.first = found[min(found)] / mcore_files.RANK_FILE
        self._files: dict[tuple[int, int], dict] = {}
        self._crcs: dict[tuple[int, int], tuple[int, ...]] = {}
        self._iteration: tuple[Any, Path] | None = None

    def rank(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._files:
            if tp_rank > 0:
                self.rank(0, pp_rank)  # the reference the other TP ranks are checked against
            path = self._path(tp_rank, pp_rank)
            crcs = mcore_files.zip_crcs(path) if path.is_file() else ()
            obj = mcore_files.load_rank_file(path, verify=False)
            rank_checks.check_slot(obj, path, tp_rank=tp_rank, pp_rank=pp_rank, args=self.args, first=self.first,
                                   par=self.par)
            if tp_rank > 0:
                rank_checks.check_same_shapes(obj, path, self._files[(0, pp_rank)], self._path(0, pp_rank),
                                              self.par.chunks)
            for (t, p), other in self._crcs.items():
                if p == pp_rank and crcs and other == crcs:
                    raise CheckpointError(f"{path} is a copy of {self._path(t, p)}: two TP ranks hold the same "
                                          f"shard, so one rank's part of every split tensor is missing; put TP rank "
                                          f"{tp_rank}'s own rank file back")
            self._crcs[key] = crcs
            iteration = obj.get("iteration")
            if self._iteration is None:
                self._iteration = (iteration, path)
            elif iteration != self._iteration[0]:
                raise CheckpointError(f"{path} is from iteration {iteration} but {self._iteration[1]} is from "
                                      f"iteration {self._iteration[0]}: the shards come from different saves")
            self._files[key] = obj
        return self._files[key]

    def _path(self, tp_rank: int, pp_rank: int) -> Path:
        return self.dir / mcore_files.rank_dir_name(tp_rank, pp_rank, self.par.pp) / mcore_files.RANK_FILE

    def tensor(self, pp_rank: int, chunk: int, name: str) -> list[torch.Tensor]:
        """The ``tp`` shards of ``name`` in the stage's chunk."""
        out = []
        for tp_rank in range(self.par.tp):
            state = self.rank(tp_rank, pp_rank).get(mcore_files.model_key(chunk, self.par.chunks)) or {}
            if name not in state:
                path = self.dir / mcore_files.rank_dir_name(tp_rank, pp_rank, self.par.pp) / mcore_files.RANK_FILE
                raise CheckpointError(f"{path}: no tensor {name!r} in its {mcore_files.model_key(chunk, self.par.chunks)} "
                                      f"state dict; the shard does not match the checkpoint's args")
            out.append(state[name])
        return out

    def has(self, pp_rank: int, chunk: int, name: str) -> bool:
        return name in (self.rank(0, pp_rank).get(mcore_files.model_key(chunk, self.par.chunks)) or {})

    def release(self, pp_rank: int) -> None:
        for tp_rank in range(self.par.tp):
            self._files.pop((tp_rank, pp_rank), None)
            self._crcs.pop((tp_rank, pp_rank), None)


def mcore_to_hf(load_dir: str | Path, out_dir: str | Path, *, template: str | Path | None = None,
                tokenizer: str | Path | None = None, dtype: str | None = None, force: bool = False,
                max_shard_bytes: int = 2 << 30, orm: bool | None = None, log=print) -> Path:
    """Merge a Megatron checkpoint (the legacy per-rank layout) into the HF directory ``out_dir``
    (config, safetensors, tokenizer); ``torch_dist`` checkpoints are merged by
    :func:`posttrain.training.megatron.dist_convert.dist_to_hf` (``posttrain convert`` picks).

    ``template`` is an HF directory whose config.json (checked against the checkpoint) and tokenizer
    are reused; ``tokenizer`` a tokenizer file or directory. Without a template the config is built
    from the checkpoint's args."""
    it_dir = mcore_files.iteration_dir(Path(load_dir))
    if mcore_files.is_dist_checkpoint(it_dir):
        raise CheckpointError(f"{it_dir} is a torch_dist checkpoint: convert it with `posttrain convert "
                              f"--load-model-type mg --save-model-type hf --load-dir {load_dir} --save-dir <dir>`")
    ckpt = McoreCheckpoint(load_dir)
    out_dir = Path(out_dir)
    check_hf_target(out_dir, force)
    out_dtype = params_dtype(dtype)
    is_rm = bool(getattr(ckpt.args, "orm", False)) or ckpt.has(ckpt.par.pp - 1, ckpt.par.chunks - 1, mapping.RM_HEAD)
    if orm and not is_rm:
        raise ConfigError(f"--orm: {ckpt.dir} is not a reward model (no {mapping.RM_HEAD} in its last stage); "
                          f"drop the flag (mg -> hf reads this from the checkpoint)")
    orm = is_rm
    config = hf_config(ckpt.arch, ckpt.args, ckpt.dir, ckpt.tensor(0, 0, mapping.EMBEDDING)[0].dtype,
                       Path(template) if template else None, orm, out_dtype)
    arch = ckpt.arch
    vocab = int(config["vocab_size"])

    def tensors():
        last = (ckpt.par.pp - 1, ckpt.par.chunks - 1)
        yield mapping.HF_EMBEDDING, splits.merge_vocab(ckpt.tensor(0, 0, mapping.EMBEDDING), vocab)
        params = mapping.layer_params(arch)
        for layer in _progress(range(arch.num_layers), "layers"):
            pp_rank, chunk, local = ckpt.par.locate(layer)
            for p in params:
                merged = mapping.merge_param(p, ckpt.tensor(pp_rank, chunk, mapping.mcore_layer_name(local, p.mcore)),
                                             arch)
                yield from ((mapping.hf_layer_name(layer, name), t) for name, t in zip(p.hf, merged))
            if layer + 1 < arch.num_layers and ckpt.par.locate(layer + 1)[0] != pp_rank and ckpt.par.chunks == 1:
                ckpt.release(pp_rank)
        yield mapping.HF_FINAL_NORM, ckpt.tensor(*last, mapping.FINAL_NORM)[0]
        if orm:
            yield mapping.HF_SCORE, splits.merge_dim(ckpt.tensor(*last, mapping.RM_HEAD), 1)
        elif not arch.tie_embeddings:
            yield mapping.HF_LM_HEAD, splits.merge_vocab(ckpt.tensor(*last, mapping.OUTPUT_LAYER), vocab)

    return write_hf(out_dir, tensors(), config, arch=arch, orm=orm, template=Path(template) if template else None,
                    tokenizer=Path(tokenizer) if tokenizer else None, out_dtype=out_dtype,
                    max_shard_bytes=max_shard_bytes, log=log, card=converted_card(load_dir, arch.model_type, orm))


def write_hf(out_dir: Path, tensors, config: dict, *, arch: ModelArch, orm: bool, template: Path | None,
             tokenizer: Path | None, out_dtype: torch.dtype | None, max_shard_bytes: int = 2 << 30,
             log=print, card: str | None = None) -> Path:
    """Write ``(HF name, tensor)`` pairs, ``config``, the tokenizer and a model ``card`` (README.md)
    as the HF directory ``out_dir`` (staged in a temporary directory, then moved in)."""
    with _staging(out_dir.parent, out_dir.name, out_dir) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, tensor in tensors:
            writer.add(name, tensor.to(out_dtype) if out_dtype else tensor)
        size = writer.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        copied = _copy_tokenizer(template, tokenizer, tmp)
        if card:
            (tmp / "README.md").write_text(card, encoding="utf-8")
        _publish_dir(tmp, out_dir)
    log(f"wrote {out_dir} ({arch.model_type}{', reward model' if orm else ''}, {arch.num_layers} layers, "
        f"{size / 2**20:.1f} MiB of weights{'; tokenizer: ' + ', '.join(copied) if copied else '; no tokenizer copied'})")
    return out_dir


def hf_config(arch: ModelArch, args, where: Path, stored: torch.dtype, template: Path | None, orm: bool,
              out_dtype: torch.dtype | None) -> dict:
    """The HF ``config.json`` of a checkpoint: the template's (checked against ``arch``), else built
    from the architecture; ``stored``: the dtype its weights are stored in."""
    if template is not None and (template / "config.json").is_file():
        config = read_hf_config(template / "config.json")
        theirs = arch_from_hf_config(template)
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads"):
            if getattr(theirs, field) != getattr(arch, field):
                raise ConfigError(f"{template / 'config.json'}: {field} is {getattr(theirs, field)} but the "
                                  f"checkpoint {where} has {getattr(arch, field)}; give the HF directory "
                                  f"of the same model (or none, to build config.json from the checkpoint)")
    else:
        config = arch.to_hf_config()
        if not getattr(args, "vocab_size", None):
            print(f"warning: {where} does not record the unpadded vocabulary; the HF model keeps the "
                  f"{arch.vocab_size} padded rows (give --save-dir an HF directory of the model to trim them)",
                  file=sys.stderr)
    config["torch_dtype"] = str(out_dtype or stored).replace("torch.", "")
    config.pop("dtype", None)
    if orm:
        config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        config["num_labels"] = 1
        config.setdefault("id2label", {"0": "LABEL_0"})
        config.setdefault("label2id", {"LABEL_0": 0})
    return config


def _copy_tokenizer(template: Path | None, tokenizer: Path | None, out: Path) -> list[str]:
    source = tokenizer or template
    if source is None:
        return []
    if not source.exists():
        raise ConfigError(f"--tokenizer-model {source} does not exist")
    copied = copy_tokenizer(source, out)
    if tokenizer is not None and not copied:
        raise ConfigError(f"--tokenizer-model {source} holds none of the tokenizer files "
                          f"({', '.join(TOKENIZER_FILES[:3])}, ...); give the model's tokenizer directory or file")
    return copied


def check_hf_target(out_dir: Path, force: bool) -> None:
    """Refuse a non-empty HF target unless ``force``; with it, refuse any file there that convert
    would replace but did not write (it has no place in the manifest of a previous conversion)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is an existing file; give a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not force:
        raise ConfigError(f"{out_dir} already exists and is not empty; remove it, or pass --force to replace "
                          f"the files convert wrote there (config, weights, tokenizer; nothing else is deleted)")
    clash = targets.foreign_files(out_dir)
    if clash:
        raise ConfigError(f"{out_dir / clash[0]} was not written by posttrain convert ({len(clash)} such file"
                          f"{'s' if len(clash) > 1 else ''}: {', '.join(clash[:4])}); --force replaces only the files "
                          f"a previous conversion listed in {out_dir / targets.MANIFEST}. Move them away or give "
                          f"another directory")


def _publish_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished files into ``out_dir`` (see :func:`targets.publish_hf`)."""
    targets.publish_hf(tmp, out_dir)


@contextlib.contextmanager
def _staging(parent: Path, prefix: str, target: Path | None = None) -> Iterator[Path]:
    """A staging directory in ``parent`` (see :func:`targets.staging`); ``prefix`` labels it."""
    with targets.staging(parent, prefix.strip(".").rstrip("-").replace(".tmp", ""), target) as tmp:
        yield tmp


def _progress(items, unit: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return items
    return tqdm(items, desc="convert", unit=f" {unit}", leave=False, disable=not sys.stderr.isatty())
