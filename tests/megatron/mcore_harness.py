"""Test-only harness: run a Megatron legacy checkpoint through Megatron-Core's own ``GPTModel``.

This is the independent check for ``posttrain convert``: it reads a checkpoint in Megatron's
legacy (non-distributed) layout, builds ``megatron.core.models.gpt.GPTModel`` with the local
(no Transformer Engine) layer spec on CPU, loads each rank's shard with ``strict=True`` and runs
Megatron's own pipeline schedules over gloo. Nothing here imports ``posttrain``.

Checkpoint layout read (``ckpt_root``)::

    latest_checkpointed_iteration.txt          "release" or an iteration number N
    release/ | iter_{N:07d}/
        mp_rank_{tp:02d}/model_optim_rng.pt            (pp == 1)
        mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (pp > 1)

Each file: ``{"model": state_dict, "checkpoint_version": 3.0, "iteration": 0,
"args": argparse.Namespace}``; with virtual pipeline stages ``model0``, ``model1``, ... (one per
chunk on that pipeline rank) instead of ``model``. Layer indices inside a shard are local
(``decoder.layers.0`` is the first layer of that chunk).

Public API:

* ``mcore_logits(ckpt_root, input_ids, *, tp, pp, vpp=None, num_layer_list=None,
  backward=False, timeout_s=...) -> dict``
* ``mcore_run_many(jobs, *, world_size=None, timeout_s=...) -> list[dict]`` - several
  checkpoints/layouts in one set of spawned processes (spawning costs seconds per process).
* ``mcore_expected_keys(args, *, tp, pp, vpp=None, num_layer_list=None) -> dict`` - the
  state-dict keys and shapes mcore builds on each rank (what a converter has to write).
* ``hf_reference_logits(hf_dir, input_ids) -> Tensor``
* ``read_latest_dir``, ``shard_path``, ``load_shard`` - the checkpoint reading used above.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from posttrain.training.megatron.cpu_shims import cpu_megatron
from posttrain.training.megatron.model import arg as _arg
from posttrain.training.megatron.model import build_chunks as _build_chunks
from posttrain.training.megatron.model import transformer_config as transformer_config_from_args

__all__ = [
    "HarnessError",
    "hf_reference_logits",
    "load_shard",
    "mcore_expected_keys",
    "mcore_logits",
    "mcore_run_many",
    "read_latest_dir",
    "shard_path",
]

DEFAULT_TIMEOUT_S = 600.0
CKPT_FILE = "model_optim_rng.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


class HarnessError(RuntimeError):
    """A spawned Megatron rank failed; the message holds each failing rank's traceback."""


# --------------------------------------------------------------------------------------------
# Checkpoint reading (runs in the children; pure functions, usable from a test too)
# --------------------------------------------------------------------------------------------


def read_latest_dir(ckpt_root: str | os.PathLike) -> Path:
    """``ckpt_root/release`` or ``ckpt_root/iter_{N:07d}``, from ``latest_checkpointed_iteration.txt``."""
    root = Path(ckpt_root)
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        raise FileNotFoundError(f"no {TRACKER_FILE} in {root}")
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release"
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected 'release' or an iteration number, got {text!r}")
    return root / f"iter_{int(text):07d}"


def shard_path(ckpt_dir: str | os.PathLike, tp_rank: int, pp_rank: int, pp: int) -> Path:
    """Megatron's legacy file name for one (tp_rank, pp_rank) shard."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return Path(ckpt_dir) / name / CKPT_FILE


def _safe_globals() -> list:
    """Types a Megatron ``args`` Namespace may hold, for ``torch.load(weights_only=True)``."""
    import io
    import pathlib
    import types

    allowed: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO]
    try:  # numpy scalars/dtypes (e.g. a float64 learning rate in args)
        import numpy as np

        allowed += [np.dtype, np.ndarray] + [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
        try:
            from numpy._core.multiarray import _reconstruct, scalar
        except ImportError:  # numpy < 2
            from numpy.core.multiarray import _reconstruct, scalar
        allowed += [_reconstruct, scalar]
    except ImportError:
        pass
    if "megatron.core" in sys.modules:  # Megatron-LM's own list (AttnBackend, ModelType, ...)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from megatron.core.safe_globals import SAFE_GLOBALS

                allowed += list(SAFE_GLOBALS)
            except Exception:  # noqa: BLE001 - best effort
                pass
    return allowed


def load_shard(path: str | os.PathLike) -> dict:
    """``torch.load(weights_only=True)`` of one ``model_optim_rng.pt`` (Namespace args allowed)."""
    with torch.serialization.safe_globals(_safe_globals()):
        try:  # mmap: reading only the args of a big shard stays cheap
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # legacy (non-zip) files cannot be mmapped
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------
# Model construction from Megatron args (children only)
# --------------------------------------------------------------------------------------------


def _parse_layer_list(num_layer_list) -> Optional[list[int]]:
    if num_layer_list is None or num_layer_list == "":
        return None
    if isinstance(num_layer_list, str):
        return [int(x) for x in num_layer_list.split(",") if x.strip()]
    return [int(x) for x in num_layer_list]


def resolve_layout(args: argparse.Namespace, tp: int, pp: int, vpp, num_layer_list):
    """Check the caller's tp/pp/vpp against the checkpoint args; returns (vpp, layer_list).

    ``vpp``/``num_layer_list`` left as None are taken from the args
    (``virtual_pipeline_model_parallel_size`` or ``num_layers_per_virtual_pipeline_stage``,
    ``num_layer_list``). A vpp of 1 means no interleaving."""
    a_tp = _arg(args, "tensor_model_parallel_size", 1)
    a_pp = _arg(args, "pipeline_model_parallel_size", 1)
    if (a_tp, a_pp) != (tp, pp):
        raise ValueError(f"checkpoint args say tp={a_tp} pp={a_pp}, caller asked tp={tp} pp={pp}")
    a_vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if a_vpp is None and per_stage:
        a_vpp = args.num_layers // pp // per_stage
    a_vpp = None if a_vpp in (None, 1) else int(a_vpp)
    vpp = None if vpp in (None, 1) else int(vpp)
    if vpp is None:
        vpp = a_vpp
    elif a_vpp is not None and a_vpp != vpp:
        raise ValueError(f"checkpoint args say vpp={a_vpp}, caller asked vpp={vpp}")
    if vpp is not None and pp == 1:
        raise ValueError("virtual pipeline stages need pp > 1")
    layers = _parse_layer_list(num_layer_list)
    a_layers = _parse_layer_list(getattr(args, "num_layer_list", None))
    if layers is None:
        layers = a_layers
    elif a_layers is not None and a_layers != layers:
        raise ValueError(f"checkpoint args say num_layer_list={a_layers}, caller asked {layers}")
    if layers is not None:
        stages = pp * (vpp or 1)
        if len(layers) != stages:
            raise ValueError(
                f"num_layer_list {layers} needs one entry per (virtual) pipeline stage: {stages}"
                " (with vpp, in model order: chunk 0 of every pp rank, then chunk 1, ...)"
            )
        if sum(layers) != args.num_layers:
            raise ValueError(f"num_layer_list {layers} does not add up to num_layers={args.num_layers}")
    return vpp, layers


# --------------------------------------------------------------------------------------------
# One job inside a rank
# --------------------------------------------------------------------------------------------


def _tp_all_gather_last_dim(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if ps.get_tensor_model_parallel_world_size() == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _tp_sharded_param_names(chunk) -> set[str]:
    """Parameters split across TP ranks: column-parallel weight/bias, vocab-parallel embedding,
    row-parallel weight (its bias and all norms are replicated). Decided by module type because
    mcore only sets ``param.tensor_model_parallel`` when ``perform_initialization`` is on."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    names = set()
    for mod_name, module in chunk.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            names.update(prefix + n for n, _ in module.named_parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):
            names.add(prefix + "weight")
    return names


def _canonical_name(name: str, layer_ids: dict[int, int]) -> str:
    """Local ``decoder.layers.{i}`` -> global layer index (``layer_number - 1``)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layer_ids[int(m.group(1))]}.", name)


def _setup(args: argparse.Namespace, tp: int, pp: int, vpp, layers):
    """initialize_model_parallel + this rank's GPTModel chunks (one per virtual stage)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    config = transformer_config_from_args(args, tp, pp, vpp, layers)
    return _build_chunks(args, config, vpp)


def _expected_keys(job: dict) -> Optional[dict]:
    """The state-dict keys (and shapes; None for ``_extra_state``) mcore builds on this rank."""
    from megatron.core import parallel_state as ps

    args = job["args"]
    vpp, layers = resolve_layout(args, job["tp"], job["pp"], job.get("vpp"), job.get("num_layer_list"))
    chunks = _setup(args, job["tp"], job["pp"], vpp, layers)
    keys = [f"model{i}" for i in range(vpp)] if vpp else ["model"]
    out = {
        key: {k: (tuple(v.shape) if torch.is_tensor(v) else v) for k, v in chunk.state_dict().items()}
        for key, chunk in zip(keys, chunks)
    }
    ranks = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    dp_rank = ps.get_data_parallel_rank()
    ps.destroy_model_parallel()
    return {"keys": {ranks: out}} if dp_rank == 0 else None


def _run_job(job: dict) -> Optional[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if job.get("kind") == "keys":
        return _expected_keys(job)
    tp, pp = job["tp"], job["pp"]
    ckpt_dir = read_latest_dir(job["ckpt_root"])
    # rank 0's args first: vpp must be known before initialize_model_parallel (mmap: cheap)
    head = load_shard(shard_path(ckpt_dir, 0, 0, pp))
    vpp, layers = resolve_layout(head["args"], tp, pp, job.get("vpp"), job.get("num_layer_list"))
    chunks = _setup(head["args"], tp, pp, vpp, layers)
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    path = shard_path(ckpt_dir, tp_rank, pp_rank, pp)
    ckpt = head if (tp_rank, pp_rank) == (0, 0) else load_shard(path)
    args = ckpt["args"]
    tied = not bool(_arg(args, "untie_embeddings_and_output_weights", False))

    model_keys = sorted(k for k in ckpt if k == "model" or re.fullmatch(r"model\d+", k))
    want_keys = [f"model{i}" for i in range(vpp)] if vpp else ["model"]
    if model_keys != sorted(want_keys):
        raise KeyError(f"{path}: model keys {model_keys}, expected {want_keys} (vpp={vpp})")
    for key, chunk in zip(want_keys, chunks):
        try:
            chunk.load_state_dict(ckpt[key], strict=True)
        except Exception as exc:
            raise RuntimeError(f"{path} [{key}] (tp_rank={tp_rank}, pp_rank={pp_rank}): {exc}") from exc
    for chunk in chunks:
        chunk.train(False)  # dropout is 0 anyway; eval() keeps any mode-dependent path fixed

    input_ids = job["input_ids"].to(torch.int64)
    batch, seq = input_ids.shape
    if vpp and batch < pp:
        raise ValueError(f"the interleaved schedule needs batch size >= pp ({batch} < {pp})")
    position_ids = torch.arange(seq, dtype=torch.int64).unsqueeze(0)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    loss_mask = torch.ones(batch, seq, dtype=torch.float32)
    loss_mask[:, -1] = 0.0
    n_tokens = float(loss_mask.sum())
    microbatches = [
        {"index": b, "tokens": input_ids[b : b + 1], "labels": labels[b : b + 1], "loss_mask": loss_mask[b : b + 1]}
        for b in range(batch)
    ]

    logits_out: dict[int, torch.Tensor] = {}
    loss_sums: list[torch.Tensor] = []

    def loss_func(mb: dict, logits: torch.Tensor):
        # logits: [1, T, padded_vocab / tp] (GPTModel returns batch-first when labels is None)
        logits_out[mb["index"]] = _tp_all_gather_last_dim(logits.detach())
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits.float().contiguous(), mb["labels"])
        loss_sum = (ce * mb["loss_mask"]).sum()
        loss_sums.append(loss_sum.detach())
        # the schedule divides by num_microbatches: scale so the total is the mean over all tokens
        return loss_sum * (batch / n_tokens), {"loss_sum": loss_sum.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], position_ids, causal)
        return out, partial(loss_func, mb)

    data_iterator = [iter(microbatches) for _ in chunks] if vpp else iter(microbatches)
    backward = bool(job.get("backward", False))
    schedule = get_forward_backward_func()
    with contextlib.nullcontext() if backward else torch.no_grad():
        schedule(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=chunks,
            num_microbatches=batch,
            seq_length=seq,
            micro_batch_size=1,
            forward_only=not backward,
        )

    result: dict[str, Any] = {}
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        result["logits"] = torch.cat([logits_out[b] for b in range(batch)], dim=0).float()
        result["loss"] = float(sum(loss_sums)) / n_tokens
        result["args"] = dict(vars(args))

    if backward:
        # Megatron's finalize_model_grads (not run: no DDP wrapper here) SUM-all-reduces the
        # q_layernorm/k_layernorm grads over TP: each rank only sees its own heads' share.
        qk_grads = [
            p.grad for c in chunks for n, p in c.named_parameters()
            if ("q_layernorm" in n or "k_layernorm" in n) and p.grad is not None
        ]
        if tp > 1 and qk_grads:
            flat = torch.cat([g.reshape(-1) for g in qk_grads])
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, synced in zip(qk_grads, flat.split([g.numel() for g in qk_grads])):
                g.copy_(synced.view_as(g))
        emb_local: Optional[torch.Tensor] = None
        entries: list[tuple[str, torch.Tensor, bool]] = []
        for chunk in chunks:
            layer_ids = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
            sharded_names = _tp_sharded_param_names(chunk)
            for name, param in chunk.named_parameters():
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                if name == "embedding.word_embeddings.weight" or (tied and name == "output_layer.weight"):
                    # word embedding grad: input side plus (tied, pp > 1) the last stage's copy
                    emb_local = grad.clone() if emb_local is None else emb_local + grad
                    continue
                sharded = name in sharded_names
                entries.append((_canonical_name(name, layer_ids), grad.double().pow(2).sum(), sharded))
        if entries:
            sq = torch.stack([v for _, v, _ in entries])
            is_sharded = torch.tensor([s for _, _, s in entries])
            sharded_sq = torch.where(is_sharded, sq, torch.zeros_like(sq))
            if tp > 1:
                dist.all_reduce(sharded_sq, group=ps.get_tensor_model_parallel_group())
            sq = torch.where(is_sharded, sharded_sq, sq)
            result["grad_sq_norms"] = {name: float(v) for (name, _, _), v in zip(entries, sq)}
        if emb_local is not None:
            result["emb_grad_part"] = _tp_all_gather_last_dim(emb_local, dim=0)

    ps.destroy_model_parallel()
    if tp_rank != 0 or dp_rank != 0 or not result:
        return None
    result["pp_rank"] = pp_rank
    return result


# --------------------------------------------------------------------------------------------
# Process plumbing
# --------------------------------------------------------------------------------------------


def _worker(rank: int, world_size: int, port: int, jobs: list, out_dir: str, timeout_s: float) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # megatron warns about missing apex/TE on import
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(30.0, timeout_s)),
        )
        with cpu_megatron():
            for i, job in enumerate(jobs):
                try:
                    res = _run_job(job)
                except Exception as exc:
                    raise HarnessError(f"job {i} ({_describe(job)}) failed on rank {rank}") from exc
                if res is not None:
                    torch.save(res, out / f"job{i}_rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        tmp = out / f"rank{rank}.err.tmp"
        tmp.write_text(traceback.format_exc())
        tmp.rename(out / f"rank{rank}.err")
        os._exit(1)  # do not wait for peers stuck in a collective


# each rank's entry point; the repository root goes on its PYTHONPATH, so that it imports this harness
# as tests.megatron.mcore_harness
ROOT = Path(__file__).resolve().parents[2]
_CHILD = "import sys; from tests.megatron import mcore_harness; mcore_harness._worker_main(sys.argv[1:])"


def _worker_main(argv: list[str]) -> None:
    """Child entry point: ``rank world_size port out_dir timeout_s`` (jobs in out_dir/jobs.pt)."""
    rank, world, port, out_dir, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], float(argv[4])
    try:
        jobs = torch.load(Path(out_dir) / "jobs.pt", weights_only=False)  # written by the parent
    except BaseException:  # noqa: BLE001
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    _worker(rank, world, port, jobs, out_dir, timeout_s)


def _describe(job: dict) -> str:
    return f"{job['ckpt_root']} tp={job['tp']} pp={job['pp']} vpp={job.get('vpp')} layers={job.get('num_layer_list')}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _normalize_job(job: dict) -> dict:
    if job.get("kind") == "keys":
        unknown = set(job) - {"kind", "args", "tp", "pp", "vpp", "num_layer_list"}
        if unknown:
            raise TypeError(f"unknown job keys: {sorted(unknown)}")
        return {"kind": "keys", "args": job["args"], "tp": int(job.get("tp", 1)), "pp": int(job.get("pp", 1)),
                "vpp": job.get("vpp"), "num_layer_list": job.get("num_layer_list"), "ckpt_root": "<args>"}
    unknown = set(job) - {"kind", "ckpt_root", "input_ids", "tp", "pp", "vpp", "num_layer_list", "backward"}
    if unknown:
        raise TypeError(f"unknown job keys: {sorted(unknown)}")
    ids = torch.as_tensor(job["input_ids"])
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
    return {
        "ckpt_root": str(job["ckpt_root"]),
        "input_ids": ids.to(torch.int64).cpu().clone(),
        "tp": int(job.get("tp", 1)),
        "pp": int(job.get("pp", 1)),
        "vpp": job.get("vpp"),
        "num_layer_list": job.get("num_layer_list"),
        "backward": bool(job.get("backward", False)),
    }


def _assemble(job: dict, parts: list[dict]) -> dict:
    if not parts:
        raise HarnessError(f"no result came back for {_describe(job)}")
    if job.get("kind") == "keys":
        return dict(sorted(kv for part in parts for kv in part["keys"].items()))
    result: dict[str, Any] = {}
    for part in parts:
        for key in ("logits", "loss", "args"):
            if key in part:
                result[key] = part[key]
    if job["backward"]:
        grad_sq: dict[str, float] = {}
        emb = None
        for part in parts:
            grad_sq.update(part.get("grad_sq_norms", {}))
            if "emb_grad_part" in part:
                emb = part["emb_grad_part"] if emb is None else emb + part["emb_grad_part"]
        grad_sq["embedding.word_embeddings.weight"] = float(emb.double().pow(2).sum())
        result["embedding_grad"] = emb.float()
        result["grad_sq_norms"] = dict(sorted(grad_sq.items()))
        result["grad_norm"] = sum(grad_sq.values()) ** 0.5
    return result


def mcore_run_many(
    jobs: Sequence[dict], *, world_size: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict]:
    """Run several jobs (each a dict of ``mcore_logits`` keyword arguments plus ``ckpt_root`` and
    ``input_ids``; or ``kind="keys"`` with ``mcore_expected_keys`` arguments) one after another
    in ONE set of ``world_size`` spawned gloo ranks.

    ``world_size`` defaults to the largest ``tp * pp``; every job's ``tp * pp`` must divide it
    (the remaining factor becomes data parallelism: replicas compute the same thing, rank 0's
    copy is returned). Returns one result dict per job, as ``mcore_logits`` describes.

    Each rank is a fresh ``python -c`` subprocess (so no state leaks between calls and the
    caller's ``__main__`` is never re-imported); its output goes to a log whose tail is shown if
    it dies without a traceback."""
    jobs = [_normalize_job(j) for j in jobs]
    if not jobs:
        return []
    world = world_size or max(j["tp"] * j["pp"] for j in jobs)
    for j in jobs:
        if world % (j["tp"] * j["pp"]):
            raise ValueError(f"world size {world} is not a multiple of tp*pp for {_describe(j)}")

    with tempfile.TemporaryDirectory(prefix="mcore_harness_") as tmp:
        out = Path(tmp)
        torch.save(jobs, out / "jobs.pt")
        port = _free_port()
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        procs, logs = [], []
        try:
            for r in range(world):
                log = open(out / f"rank{r}.log", "wb")
                logs.append(log)
                cmd = [sys.executable, "-c", _CHILD, str(r), str(world), str(port), tmp, str(timeout_s)]
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp))
            deadline = time.monotonic() + timeout_s
            timed_out = False
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes) or any(out.glob("rank*.err")):
                    grace = time.monotonic() + 2.0  # let the other ranks write their own traceback
                    while time.monotonic() < grace and any(p.poll() is None for p in procs):
                        time.sleep(0.05)
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
            codes = [p.poll() for p in procs]  # None: still running (stuck in a collective)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            for log in logs:
                log.close()
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or timed_out or None in codes:
            parts = []  # the first rank to fail (the cause) first; peers then fail in collectives
            errs = sorted(out.glob("rank*.err"), key=lambda e: e.stat().st_mtime_ns)
            for err in errs:
                r = int(err.name[4:-4])
                parts.append(f"----- {err.name} (exit {codes[r]}) -----\n{err.read_text()}")
            for r, c in enumerate(codes):
                if c not in (None, 0) and not (out / f"rank{r}.err").exists():
                    tail = (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
                    parts.append(f"----- rank{r} exited {c} without a traceback file, log tail -----\n{tail}")
            what = f"timed out after {timeout_s:.0f}s" if timed_out else f"failed (exit codes {codes})"
            raise HarnessError(f"Megatron harness {what}\n" + "\n".join(parts))
        results = []
        for i, job in enumerate(jobs):
            files = sorted(out.glob(f"job{i}_rank*.pt"))
            results.append(_assemble(job, [torch.load(f, weights_only=False) for f in files]))
        return results


def mcore_logits(
    ckpt_root: str | os.PathLike,
    input_ids: torch.Tensor,
    *,
    tp: int,
    pp: int,
    vpp: Optional[int] = None,
    num_layer_list: Optional[str | Sequence[int]] = None,
    backward: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict:
    """Load the legacy checkpoint at ``ckpt_root`` into Megatron-Core's ``GPTModel`` on
    ``tp * pp`` spawned CPU ranks and run ``input_ids`` ([B, T] int64; positions 0..T-1, causal
    mask, fp32) through Megatron's schedule (1F1B for pp > 1, interleaved with vpp; B
    micro-batches of 1 sequence each; the interleaved schedule needs B >= pp).

    ``vpp``/``num_layer_list`` default to the checkpoint args. ``num_layer_list`` ("1,3" or
    [1, 3]) has one entry per pipeline stage, or per virtual stage in model order with vpp.

    Returns a dict:

    * ``logits``: ``[B, T, padded_vocab_size]`` float32 CPU tensor (TP shards gathered);
    * ``loss``: mean next-token cross entropy over the B*(T-1) predicted positions
      (Megatron's ``vocab_parallel_cross_entropy``);
    * ``args``: the checkpoint's args as a dict;
    * with ``backward=True`` (schedule run with ``forward_only=False`` on that loss):
      ``embedding_grad`` (full ``[padded_vocab, hidden]`` word-embedding gradient, TP shards
      concatenated, and with tied embeddings and pp > 1 the last stage's ``output_layer``
      gradient added, as Megatron's embedding-group all-reduce would),
      ``grad_sq_norms`` (squared gradient norm per parameter under its global name,
      e.g. ``decoder.layers.3.mlp.linear_fc1.weight``: TP shards summed, replicated params
      counted once; q/k_layernorm grads first summed over TP ranks as Megatron's
      ``finalize_model_grads`` does), ``grad_norm`` (sqrt of their sum).

    Raises ``HarnessError`` with the failing rank's traceback (e.g. a strict
    ``load_state_dict`` key mismatch) or on timeout."""
    job = dict(ckpt_root=ckpt_root, input_ids=input_ids, tp=tp, pp=pp, vpp=vpp,
               num_layer_list=num_layer_list, backward=backward)
    return mcore_run_many([job], timeout_s=timeout_s)[0]


def mcore_expected_keys(
    args: argparse.Namespace,
    *,
    tp: int,
    pp: int,
    vpp: Optional[int] = None,
    num_layer_list: Optional[str | Sequence[int]] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict:
    """What a converter must write: builds the GPTModel chunks from Megatron ``args`` (no
    checkpoint) on ``tp * pp`` ranks and returns ``{(tp_rank, pp_rank): {"model" | "model{i}":
    {state_dict_key: shape tuple, or None for an ``_extra_state`` entry}}}``."""
    job = dict(kind="keys", args=args, tp=tp, pp=pp, vpp=vpp, num_layer_list=num_layer_list)
    return mcore_run_many([job], timeout_s=timeout_s)[0]


def hf_reference_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` (float32, CPU) of the HF model in ``hf_dir`` on ``input_ids``
    (eager attention, positions 0..T-1, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = torch.as_tensor(input_ids).to(torch.int64)
    positions = torch.arange(ids.shape[1], dtype=torch.int64).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False)
    return out.logits.float().cpu()
