"""FSDP2 with bf16 training: parameters gathered and computed in bf16, gradients reduced and master
weights kept in fp32 (``posttrain.cluster.fsdp.shard``). One gloo rank in a subprocess, so the
test process keeps no process group."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.cluster import fsdp
    from posttrain.training.engine import TrainEngine
    from posttrain.training.options import OptimOptions

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    engine = TrainEngine(model, torch.optim.AdamW(model.parameters()), dtype=sys.argv[2])
    actor = OptimOptions(lr=1e-3, weight_decay=0.0, lr_decay_style="constant", lr_warmup_fraction=0.0)
    fsdp.shard(model, engine, actor, total_steps=2)
    seen = []
    proj = model.model.layers[0].self_attn.q_proj
    proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    model(ids, labels=ids).loss.backward()
    grads = {p.grad.dtype for p in model.parameters()}
    params = {(type(p).__name__, p.dtype) for p in model.parameters()}
    print("RESULT", seen[0], sorted(map(str, grads)), sorted(map(str, params)))
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("dtype, compute", [("bfloat16", "torch.bfloat16"), ("float32", "torch.float32")])
def test_fsdp2_mixed_precision_policy(tmp_path, dtype, compute):
    script = tmp_path / "fsdp_precision.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), dtype], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    assert line == f"RESULT {compute} ['torch.float32'] [\"('DTensor', torch.float32)\"]"
