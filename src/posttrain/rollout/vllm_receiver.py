"""Weight loading for a vLLM engine whose model lives in other processes (``separate_process``, and
always with vLLM tensor parallelism): the engine core and its workers are then vLLM's own
processes, reached through ``collective_rpc``, whose arguments travel as msgpack (tuples arrive
as lists, and a tensor arrives as vLLM's raw encoding, not a tensor). So a decoder layer travels as
one safetensors blob (:func:`pack`, bytes that msgpack and pickle carry as they are), and
:class:`WeightReceiver`, installed on every vLLM worker as its ``worker_extension_cls``, unpacks it
into ``(HF name, tensor)`` pairs and hands them to the worker's ``reload_weights`` (what the
in-process engine calls by name), which each worker cuts into its own tensor-parallel shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

RECEIVER = "posttrain.rollout.vllm_receiver.WeightReceiver"  # the LLM's worker_extension_cls
LOAD_METHOD = "posttrain_load_weights"


def pack(bucket: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """One bucket of ``(HF name, tensor)`` pairs as safetensors bytes (on the CPU, contiguous)."""
    from safetensors.torch import save

    return save({name: tensor.detach().cpu().contiguous() for name, tensor in bucket})


class WeightReceiver:
    """Mixed into each vLLM worker (``worker_extension_cls``): its methods are callable through
    ``LLM.collective_rpc`` by name, with ``self`` the worker."""

    def posttrain_load_weights(self, blob: bytes) -> int:
        """Reload the weights in ``blob`` (:func:`pack`) in place; returns how many tensors it held."""
        from safetensors.torch import load

        pairs = list(load(bytes(blob)).items())
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)  # the worker's, as in-process
        return len(pairs)
