"""Spike for expert parallelism on a CPU (the part of issue 17 still refused): can Megatron-Core
0.16.1 build, run forward and backward a local-spec MoE ``GPTModel`` on gloo at EP 1 and EP 2?

Findings (2026-12-02, torch 2.13, megatron-core 0.16.1, no TransformerEngine/Apex):

* gloo in torch 2.13 has ``all_to_all_single``, ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor``.
* ``moe_token_dispatcher_type: alltoall`` fails at construction: ``MoEAlltoAllTokenDispatcher``
  creates a ``torch.cuda.Stream``. ``allgather`` constructs and runs.
* The router's ``RouterGatingLinearFunction`` reads ``te_general_gemm``, a name
  ``moe_utils`` defines only when TransformerEngine imports (a NameError otherwise): setting
  ``moe_utils.te_general_gemm = None`` lets it take its ``torch.mm`` path.
* With those two, forward and backward run at EP 1 and EP 2 (2 gloo ranks) inside
  ``cpu_megatron()``. Parameter names (local spec, ``moe_grouped_gemm`` off):
  ``decoder.layers.{i}.mlp.router.weight`` [E, H] and
  ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight`` [2F, H] (gate, up) /
  ``linear_fc2.weight`` [H, F], ``e`` local to the EP rank. HF Qwen3-MoE checkpoints store
  ``model.layers.{i}.mlp.gate.weight`` and ``mlp.experts.{e}.{gate,up,down}_proj.weight`` on disk
  (transformers 5 fuses them in memory only).
* Not checked yet: numerical equality with HF's Qwen3-MoE (softmax top-k with ``norm_topk_prob``
  should match Megatron's default top-k-then-softmax), the aux loss, and the mapping itself.

    .venv/bin/python benchmarks/megatron/spike_moe_ep.py
"""

from __future__ import annotations

import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp


def run(rank: int, port: int, ep: int, dispatcher: str, results) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils

    from posttrain.train.megatron.cpu_shims import cpu_megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the router's torch.mm path (see the findings)
    try:
        with cpu_megatron():
            ps.initialize_model_parallel(expert_model_parallel_size=ep)
            model_parallel_cuda_manual_seed(0)
            config = TransformerConfig(
                num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=8, qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
                normalization="RMSNorm", add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=16,
                moe_router_topk=2, moe_router_load_balancing_type="none", moe_token_dispatcher_type=dispatcher,
                expert_model_parallel_size=ep, use_cpu_initialization=True, params_dtype=torch.float32,
                pipeline_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False,
                masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                hidden_dropout=0.0, attention_dropout=0.0, moe_permute_fusion=False)
            spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True,
                                            normalization="RMSNorm")
            model = GPTModel(config, spec, vocab_size=128, max_sequence_length=64, position_embedding_type="rope",
                             share_embeddings_and_output_weights=False)
            ids, positions = torch.randint(0, 100, (1, 8)), torch.arange(8)[None]
            mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
            model(ids, positions, mask).sum().backward()
            ps.destroy_model_parallel()
        results[rank] = "forward + backward run"
    except Exception as err:  # noqa: BLE001 - the spike records what fails
        results[rank] = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        if "--traces" in sys.argv:
            traceback.print_exc()
    finally:
        dist.destroy_process_group()


def main() -> None:
    for dispatcher in ("alltoall", "allgather"):
        for ep in (1, 2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            results = mp.Manager().dict()
            mp.spawn(run, args=(port, ep, dispatcher, results), nprocs=ep, join=True)
            print(f"dispatcher {dispatcher:<9} EP {ep}: {results.get(0)}")


if __name__ == "__main__":
    main()
