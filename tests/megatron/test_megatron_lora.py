"""LoRA on the Megatron-Core backend (posttrain.training.megatron.lora) against PEFT on the HF model,
at TP 2, TP 1 and PP 2 (2 gloo ranks; a tiny Qwen2 with 4 heads in 2 query groups, so the fused
``linear_qkv`` rows interleave q, k and v per group): PEFT's adapter (A random, B made non-zero) converted into
the fused Megatron layout gives PEFT's log-probs and, after one backward, PEFT's gradient of every
A and B; the weights streamed to the rollout are PEFT's merged ones, the gathered adapter is PEFT's
own state dict, and with the adapter switched off the model is the base."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks
from tests.megatron.test_megatron_update import TEMPERATURE, grpo_batch

pytestmark = pytest.mark.slow
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def peft_model(hf_dir: str, targets):
    """The HF model with PEFT's adapter (seeded) and every B drawn non-zero (PEFT starts B at 0)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import LoraOptions, add_adapter

    torch.manual_seed(7)
    model = add_adapter(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                        LoraOptions(r=4, alpha=8, target_modules=tuple(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model


def worker(rank: int, hf_dir: str, targets: list[str], tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps
    from peft import get_peft_model_state_dict

    from posttrain.models.lora import LoraOptions
    from posttrain.training.engine import TrainEngine
    from posttrain.training.megatron import lora
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron, hf_weights

    batch = grpo_batch(hf_dir)
    model = peft_model(hf_dir, targets)
    want = TrainEngine(model, micro_batch_size=4).compute_logprobs(batch, temperature=TEMPERATURE)
    with model.disable_adapter():
        want_base = TrainEngine(model, micro_batch_size=4).compute_logprobs(batch, temperature=TEMPERATURE)
    init = {(int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[-1]):
            (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
            for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    options = LoraOptions(r=4, alpha=8, target_modules=tuple(targets))
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        chunks, args = hf_to_megatron(hf_dir, for_training=True)
        lora.attach(chunks, args, options, init)
        assert {n for n, p in chunks[0].named_parameters() if p.requires_grad} == \
            {n for n, _ in chunks[0].named_parameters() if ".lora." in n}
        engine = MegatronEngine(chunks, vocab_size=100)
        got = engine.compute_logprobs(batch, temperature=TEMPERATURE)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert (got - want_base).abs().max() > 1e-2  # the adapter changes the model
        with lora.AdapterSwitch(chunks).disable_adapter():
            torch.testing.assert_close(engine.compute_logprobs(batch, temperature=TEMPERATURE), want_base,
                                       rtol=0, atol=2e-5)

        if pp == 1:  # gradients: the whole model on this rank
            _assert_pefts_gradients(model, chunks, args, options, batch)

        # the rollout's weights are PEFT's merged ones; the gathered adapter is PEFT's state dict
        merged = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
        streamed = dict(hf_weights(chunks, args))
        assert streamed.keys() == merged.keys()
        for name, tensor in streamed.items():
            torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
        saved = get_peft_model_state_dict(peft_model(hf_dir, targets))
        gathered = dict(lora.adapter_weights(chunks, args, options))
        assert gathered.keys() == saved.keys()
        for key, tensor in saved.items():
            torch.testing.assert_close(gathered[key], tensor, rtol=0, atol=0, msg=key)
        ps.destroy_model_parallel()


def _assert_pefts_gradients(model, chunks, args, options, batch) -> None:
    """The gradient of the summed log-probs of one unpadded row: every A and B as PEFT's."""
    from posttrain.training.megatron.vocab_parallel import vocab_parallel_logprobs

    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()][None]  # row 0 without its padding
    targets_ids = ids[:, 1:]
    hf_logits = model(input_ids=ids).logits[:, :-1].float()
    hf_loss = torch.log_softmax(hf_logits, -1).gather(-1, targets_ids[..., None]).sum()
    hf_loss.backward()
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]
    logits = chunks[0](ids, torch.arange(ids.shape[1])[None], mask)[:, :-1]
    vocab_parallel_logprobs(logits, targets_ids, vocab_size=100, temperature=1.0).sum().backward()
    want_grads = {k.replace(".default", ""): p.grad for k, p in model.named_parameters() if p.grad is not None}
    checked = 0
    for key, grad in _gathered_grads(chunks, args, options).items():
        torch.testing.assert_close(grad, want_grads[key], rtol=1e-4, atol=1e-6, msg=key)
        checked += 1
    assert checked == len(want_grads) > 0


def _gathered_grads(chunks, args, options) -> dict[str, torch.Tensor]:
    """Every adapter matrix's gradient under PEFT's parameter name (gathered over TP)."""
    from posttrain.training.megatron import lora

    saved = {}
    for adapter in lora.adapted_linears(chunks):
        for matrix in ("A", "B"):
            for param in getattr(adapter, matrix).values():
                saved[id(param)] = param.data.clone()
                param.data.copy_(param.grad)
    grads = dict(lora.adapter_weights(chunks, args, options))
    for adapter in lora.adapted_linears(chunks):
        for matrix in ("A", "B"):
            for param in getattr(adapter, matrix).values():
                param.data.copy_(saved[id(param)])
    return grads


@pytest.mark.parametrize("targets,tp,pp", [(TARGETS, 2, 1), (["q_proj", "v_proj", "up_proj", "o_proj"], 1, 1),
                                           (TARGETS, 1, 2)], ids=["all-tp2", "some-hf-tp1", "all-pp2"])
def test_the_fused_megatron_adapter_is_pefts(tiny_hf, tmp_path, targets, tp, pp):
    """TP 2: the adapters split over the ranks (one query group each); TP 1 (2 data-parallel
    ranks): both query groups on a rank, their q, k and v rows interleaved; PP 2: the adapter
    and the merged weights gathered from both stages (gradients are checked without PP)."""
    run_on_ranks(worker, str(tiny_hf("qwen2")), targets, tp, pp, out=tmp_path)


def test_a_target_outside_a_megatron_layer_is_refused():
    from posttrain.errors import ConfigError
    from posttrain.models.lora import megatron_parts

    assert megatron_parts(["q_proj", "linear_fc1"]) == {"linear_qkv": ("q_proj",),
                                                        "linear_fc1": ("gate_proj", "up_proj")}
    with pytest.raises(ConfigError, match=r"lora_target_modules: 'lm_head' is not a linear of a Megatron layer.*"
                                          r"linear_qkv \(q_proj, k_proj, v_proj\).*linear_fc2 \(down_proj\)"):
        megatron_parts(["linear_qkv", "lm_head"])
