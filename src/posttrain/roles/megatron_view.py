"""The Megatron actor as the vLLM rollout engine sees it: :class:`MegatronView`, the duck type of
:class:`posttrain.rollout.vllm_weights.ModelView` for a model sharded over the ranks of a
data-parallel replica (tensor x pipeline parallel).

Only the replica's *leader* (TP rank 0, PP rank 0) holds the engine, but everything the engine asks
of the view is a collective over the replica: ``weights()`` gathers each layer's shards into the
Hugging Face layout (:func:`posttrain.training.megatron.model.hf_weights`), ``probe_logprobs`` is a
forward of the actor over all its ranks. So the other ranks mirror each of the leader's requests
with :meth:`MegatronView.follow` (the same collectives, in the same order, results dropped). No
process ever holds more than one layer beyond its own shards (vLLM's own copy aside).

On CUDA with ``infer_tensor_parallel_size`` > 1 the leader's vLLM workers (its own child processes)
run on the GPUs of its replica's first ranks on its node (:func:`replica_gpus`): Ray shows each
rank only its own GPU, so the leader hands vLLM the replica's through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import torch

from posttrain.errors import ConfigError
from posttrain.training.megatron.model import hf_weights


class MegatronView:
    """``config`` (the HF config), ``device_type``, ``dtype``, ``weights()``, ``probe_logprobs(ids)``
    and ``layer_outputs(ids)`` (None: the layers' outputs live on different ranks) of the actor
    whose shards on this rank are ``chunks`` (Megatron ``args``), run by its train ``engine``."""

    def __init__(self, chunks: list, args, engine, config, device: str, dtype: str):
        self.chunks, self.args, self.engine, self.config = chunks, args, engine, config
        self.device = device
        self.device_type = torch.device(device).type
        self.dtype = dtype

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)``, one layer at a time (a collective: every rank iterates it)."""
        return hf_weights(self.chunks, self.args)

    def probe_logprobs(self, ids: list[int] | None) -> torch.Tensor:
        """``log p(ids[t] | ids[:t])`` for t >= 1 by the actor at temperature 1, in fp32 on the CPU:
        a one-row batch through the engine's log-prob pass (a collective over the replica). The
        leader's ``ids`` (the engine's probe, continued by the engine itself) reach the other ranks
        first (they pass None)."""
        ids = self._leaders(ids)
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens),
                 "response_mask": torch.ones(1, len(ids) - 1, dtype=torch.long, device=self.device)}
        logprobs = self.engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=1)
        return logprobs[0].float().cpu()

    def layer_outputs(self, ids: list[int]) -> None:
        return None

    def _leaders(self, ids: list[int] | None) -> list[int]:
        """``ids`` as the replica's leader has them, on every rank of its model-parallel group (the
        leader's global rank is the group's lowest: TP rank 0, PP rank 0)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        src = min(dist.get_process_group_ranks(group))
        if (ids is not None) != (dist.get_rank() == src):
            raise RuntimeError("the probe's ids must come from the replica's leader (TP rank 0, PP rank 0) alone")
        length = torch.tensor([len(ids) if ids is not None else 0], dtype=torch.long, device=self.device)
        dist.broadcast(length, src=src, group=group)
        tokens = (torch.tensor(ids, dtype=torch.long, device=self.device) if ids is not None
                  else torch.empty(int(length.item()), dtype=torch.long, device=self.device))
        dist.broadcast(tokens, src=src, group=group)
        return tokens.tolist()

    def follow(self) -> None:
        """A rank without the engine: its part of the leader's start or weight sync (every layer
        gathered, then the probe's forward), the results dropped."""
        for _ in self.weights():
            pass
        self.probe_logprobs(None)


def pick_rollout_gpus(ranks: list[tuple[str, str]], tensor_parallel_size: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the leader's vLLM workers from ``(host, visible GPUs)`` of
    each rank of its replica (model-parallel group order, the leader first): the GPUs of the first
    ``tensor_parallel_size`` ranks on the leader's host. vLLM's workers share them with the
    training ranks (colocated, as the seed's rollout shares its NPUs; sleep mode frees vLLM's
    memory while the trainer runs). Its multiprocessing executor runs on one node, so a replica
    with fewer GPUs than that on the leader's node is refused."""
    host = ranks[0][0]
    gpus: list[str] = []
    for rank_host, visible in ranks:
        gpu = visible.split(",")[0].strip()
        if rank_host == host and gpu and gpu not in gpus:
            gpus.append(gpu)
    if len(gpus) < tensor_parallel_size:
        raise ConfigError(
            f"generate_config.infer_tensor_parallel_size={tensor_parallel_size}: the replica's leader runs vLLM's "
            f"tensor-parallel workers on its replica's GPUs on its own node ({host}), and the replica has "
            f"{len(gpus)} there; vLLM's multiprocessing executor does not span nodes, so set it to at most "
            f"{len(gpus)} (or place each replica on one node)")
    return ",".join(gpus[:tensor_parallel_size])


def replica_gpus(tensor_parallel_size: int) -> str:
    """:func:`pick_rollout_gpus` of this rank's replica: a collective over its model-parallel group
    (every rank calls it); each rank reports its host and the GPUs Ray gave it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    mine = (socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES") or str(torch.cuda.current_device()))
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, mine, group=group)
    return pick_rollout_gpus([tuple(r) for r in ranks], tensor_parallel_size)
