"""The rollout's module dumps (posttrain.loops.dump_points with posttrain.metrics.dumps) when the native
engine samples from a bf16 copy of the weights (as on a GPU): the copy's modules are named like the
model's, the token range counts its calls, and the statistics are the copy's."""

from __future__ import annotations

import json

import torch

from posttrain.loops.dump_points import engine_models
from posttrain.metrics.dumps import DumpOptions, DumpRecorder
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine


def test_the_sampling_copy_is_dumped_under_the_models_names(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=None, dtype="bfloat16", sampling_copy=True)
    recorder = DumpRecorder(DumpOptions(dump_path=str(tmp_path), roles=frozenset({"actor_infer"}), token_start=1,
                                        token_end=2))
    with recorder.step(1), recorder.watch("rollout", lambda: engine_models(engine)):
        engine.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=4, seed=0, top_k=-1))
    assert engine.samples_from_copy and engine_models(engine)[1] is not model  # the copy exists and was found
    rows = [json.loads(line) for line in (tmp_path / "step_1/rank_0/actor_infer.jsonl").open()]
    assert {r["call"] for r in rows} == {1, 2}  # the two first decode steps, not the prefill (call 0)
    down = [r for r in rows if r["name"] == "model.layers.1.mlp.down_proj" and r["tensor"] == "output"]
    assert len(down) == 2 and all(r["dtype"] == "bfloat16" and r["shape"] == [2, 1, 16] for r in down)
