"""LoRA through PEFT (posttrain.models.lora): the seed's target names, the merged rollout (bit-exact
base afterwards, the adapted model's logits), the shared-backbone reference (the base model's
log-probs exactly), and a rollout that samples from the adapter."""

from __future__ import annotations


import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models import lora


def role(**keys):
    return lora.LoraOptions(**{"r": 4, "alpha": 8,
                               "target_modules": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), **keys})


@pytest.fixture
def adapted(tiny_hf):
    """A tiny Qwen2 with a LoRA adapter whose B is random (a fresh adapter is the base exactly)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(tiny_hf("qwen2"), dtype=torch.float32), role())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model.eval()


def test_megatron_names_map_to_hf_linears_and_unknown_ones_list_what_exists(tiny_hf, adapted):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_hf("qwen2"))
    assert lora.hf_targets(["linear_qkv", "linear_fc2", "o_proj"], base) == ["q_proj", "k_proj", "v_proj",
                                                                           "down_proj", "o_proj"]
    with pytest.raises(ConfigError, match=r"'attn_qkv' matches no linear layer of the model .* its linear layers are "
                                          r"down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        lora.hf_targets(["attn_qkv"], base)
    assert [n for n, p in adapted.named_parameters() if p.requires_grad] and \
        all("lora_" in n for n, p in adapted.named_parameters() if p.requires_grad)  # only the adapter trains


def test_ten_merged_rollouts_leave_the_base_bit_identical_and_compute_the_adapted_model(adapted):
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    base = {n: p.detach().clone() for n, p in adapted.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        for _ in range(10):
            with lora.merged(adapted):
                got = adapted(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert all(torch.equal(p, base[n]) for n, p in adapted.named_parameters() if "base_layer" in n)


def test_the_shared_backbone_reference_is_the_base_model_exactly(tiny_hf, adapted):
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.batch import build_batch

    g = torch.Generator().manual_seed(2)
    batch = build_batch([torch.randint(1, 100, (5,), generator=g) for _ in range(3)],
                        [torch.randint(1, 100, (4,), generator=g) for _ in range(3)], pad_token_id=0)
    reference = lora.AdapterOff(TrainEngine(adapted, micro_batch_size=4), adapted)
    base = TrainEngine(AutoModelForCausalLM.from_pretrained(tiny_hf("qwen2"), dtype=torch.float32), micro_batch_size=4)
    want = base.compute_logprobs(batch)
    assert torch.equal(reference.compute_logprobs(batch), want)
    adapted_logprobs = TrainEngine(adapted, micro_batch_size=4).compute_logprobs(batch)
    assert not torch.allclose(adapted_logprobs, want)  # the actor is the adapted model


def test_the_rollout_samples_from_the_adapter_after_an_update(tiny_hf):
    """A fresh adapter (B = 0) rolls out as the base; one optimizer step on the adapter changes the
    rollout's log-probs, and its greedy samples are those of a plain model holding the merged
    weights (the KV cache reaches the base model through PEFT)."""
    import copy

    from transformers import AutoModelForCausalLM

    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    from posttrain.training.engine import TrainEngine
    from posttrain.training.batch import build_batch
    from posttrain.training.loss_fns import make_sft_loss_fn
    from posttrain.training.optim import build_optimizer

    def greedy(engine):
        [[out]] = engine.generate([[5, 6, 7, 8]], 1, SamplingParams(temperature=0, max_tokens=6))
        return out

    torch.manual_seed(0)
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(tiny_hf("qwen2"), dtype=torch.float32), role())
    rollout = lora.MergedRollout(NativeEngine(model, pad_token_id=0, eos_token_ids=None), model)
    before = greedy(rollout)
    g = torch.Generator().manual_seed(3)
    batch = build_batch([torch.randint(1, 100, (4,), generator=g) for _ in range(4)],
                        [torch.randint(1, 100, (6,), generator=g) for _ in range(4)], pad_token_id=0)
    engine = TrainEngine(model, build_optimizer(model, 1e-2, weight_decay=0.0), micro_batch_size=4)
    engine.update(batch, make_sft_loss_fn(), mini_batch_size=4)
    after = greedy(rollout)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)  # the rollout samples from the adapter
    want = greedy(NativeEngine(copy.deepcopy(model).merge_and_unload(), pad_token_id=0, eos_token_ids=None))
    assert after.token_ids == want.token_ids
    assert after.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.mark.parametrize("text", ['{"base_model_name_or_path": ', "[1, 2]", "\udc80"])
def test_a_broken_adapter_config_is_named_when_a_run_loads_the_adapter(tmp_path, text):
    """A LoRA checkpoint whose adapter_config.json is cut, not an object or not UTF-8 is refused
    naming the file (it was a JSONDecodeError traceback when a run loaded the adapter)."""
    from posttrain.errors import ConfigError
    from posttrain.models.lora import ADAPTER_CONFIG, adapter_base

    (tmp_path / ADAPTER_CONFIG).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=f"{ADAPTER_CONFIG}: (not valid JSON|expected a JSON object)"):
        adapter_base(tmp_path)
