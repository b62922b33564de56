"""rl_config.offload_reference on the CPU: between its uses the frozen reference holds no weights
(they wait in a memory-mapped file), and its log-probs are those of the reference kept in memory."""

from __future__ import annotations

import copy

import torch
from tests.unit.train.offload_cases import batch, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.training.engine import TrainEngine
from posttrain.training.offload import OffloadedReference


def tied_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(config).float()


def held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_offloaded_reference_gives_the_same_logprobs_and_holds_nothing_between_uses(tmp_path):
    for make in (lambda: tiny_model("cpu"), tied_llama):
        model = make().eval()
        kept = TrainEngine(copy.deepcopy(model), micro_batch_size=2)
        offloaded = OffloadedReference(TrainEngine(model, micro_batch_size=2), tmp_path / make.__name__)
        assert held_bytes(model) == 0 and (tmp_path / make.__name__ / "reference.pt").is_file()
        for _ in range(2):  # mapped back for every call, dropped after it
            got = offloaded.compute_logprobs(batch(), temperature=0.7)
            assert torch.equal(got, kept.compute_logprobs(batch(), temperature=0.7))
            assert held_bytes(model) == 0
        offloaded.dp_group = "group"  # the Ray worker gives the reference its own process group
        assert offloaded.engine.dp_group == "group"
