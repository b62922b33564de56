"""A Hugging Face model built as Megatron-Core's GPTModel (posttrain.training.megatron.model.
hf_to_megatron: this rank's weights read from the HF files, no Megatron checkpoint written, not
set up for training) gives, through MegatronEngine.compute_logprobs, the HF engine's response
log-probs and entropy on a padded batch, at TP 2 (tied Llama, 2 gloo ranks). The trained path, at
more layouts, is tests/megatron/test_megatron_update.py."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks
from tests.megatron.test_megatron_update import TEMPERATURE, grpo_batch

pytestmark = pytest.mark.slow


def worker(rank: int, hf_dir: str) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron

    batch = grpo_batch(hf_dir)
    hf = TrainEngine(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), micro_batch_size=4)
    want = hf.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        [chunk], _ = hf_to_megatron(hf_dir)
        got = MegatronEngine(chunk, vocab_size=100).compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
        ps.destroy_model_parallel()


def test_the_megatron_model_gives_the_hf_logprobs_and_entropy(tiny_hf, tmp_path):
    run_on_ranks(worker, str(tiny_hf("llama")), out=tmp_path)


def moe_worker(rank: int, hf_dir: str, tp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron, hf_weights

    batch = grpo_batch(hf_dir)
    hf = TrainEngine(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), micro_batch_size=4)
    want = hf.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        chunks, args = hf_to_megatron(hf_dir, sequence_parallel=tp > 1)  # Megatron's MoE needs SP with TP
        assert len(list(chunks[0].decoder.layers[0].mlp.experts.local_experts)) == 4 // ep
        got = MegatronEngine(chunks, vocab_size=100).compute_logprobs(batch, temperature=TEMPERATURE,
                                                                      with_entropy=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
        on_disk = load_file(f"{hf_dir}/model.safetensors")
        gathered = dict(hf_weights(chunks, args))
        assert gathered.keys() == on_disk.keys()
        for name, tensor in on_disk.items():
            torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0, msg=name)
        # the seed's router load-balancing loss (moe_router_load_balancing_type, moe_aux_loss_coeff)
        # reaches Megatron-Core: it adds to the router's gradient
        ids = batch["input_ids"][:2]
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]
        grads = []
        for coeff in (0.0, 1.0):
            [chunk], _ = hf_to_megatron(hf_dir, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=coeff,
                                        sequence_parallel=tp > 1)
            chunk(ids, torch.arange(ids.shape[1])[None], mask).sum().backward()
            grads.append(chunk.decoder.layers[0].mlp.router.weight.grad)
        assert not torch.allclose(grads[0], grads[1])
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_a_mixture_of_experts_model_gives_the_hf_logprobs_and_weights(tiny_hf, tmp_path, tp, ep):
    """Qwen3-MoE (4 experts, top 2) split over EP 2, and at TP 2 x EP 2 (4 ranks; each expert's
    MLP split over the expert tensor-parallel ranks, sequence parallel): the same log-probs and
    entropy as Hugging Face's model, hf_weights gathers every expert back to the exact HF tensors,
    and the router's load-balancing loss is Megatron-Core's when asked."""
    run_on_ranks(moe_worker, str(tiny_hf("qwen3_moe")), tp, ep, out=tmp_path, world=tp * ep)
