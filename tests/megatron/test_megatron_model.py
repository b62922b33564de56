"""The Megatron-Core backend's first pieces, on 2 gloo ranks: a Hugging Face model built as
Megatron-Core's GPTModel (posttrain.train.megatron.model.hf_to_megatron, this rank's weights read
from the HF files) gives, through the pipeline schedule and the vocab-parallel log-prob and entropy
(posttrain.train.megatron.engine.forward_logprobs), the HF model's next-token log-probs and
entropy at TP 2 and at PP 2, for a Qwen2 (qkv bias) and a tied Llama."""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow
TEMPERATURE = 0.8


def hf_logprobs(hf_dir: str, input_ids: torch.Tensor):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids).logits[:, :-1].float() / TEMPERATURE, dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


def worker(rank: int, hf_dir: str, tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    from posttrain.train.megatron.cpu_shims import cpu_megatron
    from posttrain.train.megatron.engine import forward_logprobs
    from posttrain.train.megatron.model import hf_to_megatron

    input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        chunks, args = hf_to_megatron(hf_dir)
        got = forward_logprobs(chunks, input_ids, vocab_size=100, temperature=TEMPERATURE, with_entropy=True)
        if got is not None:
            want_logp, want_entropy = hf_logprobs(hf_dir, input_ids)
            torch.testing.assert_close(got["logprobs"], want_logp, rtol=0, atol=1e-4)
            torch.testing.assert_close(got["entropy"], want_entropy, rtol=0, atol=1e-4)
        ps.destroy_model_parallel()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_the_megatron_model_gives_the_hf_logprobs_and_entropy(tiny_hf, tmp_path, kind, tp, pp):
    run_on_ranks(worker, str(tiny_hf(kind)), tp, pp, out=tmp_path)
