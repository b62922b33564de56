"""The chat rollout with its whole decode step compiled by Inductor, against the lean forward (issue 43).

An experiment, kept to reproduce a negative result (docs/performance.md, "A whole decode step
compiled"): each one-query step of ``posttrain.models.lean_forward`` (all the model's layers: norms,
rotary, the KV-cache writes, SDPA, SiLU, residual adds, the final norm and the LM head) runs as one
``torch.compile(dynamic=True)`` call, the prepacked oneDNN products (which Inductor cannot lower) as a
custom operator reading the packs from a table, the cache writes as a mutating custom operator. The
prefill and everything else run as in the engine. Workload as ``decode_speed.py``'s (SmolLM2-135M-
Instruct, 8 prompts x 8 samples, up to 64 tokens, temperature 0.5); the two variants alternate, each
repacking its weights every call as after an update; the first call of each (the compilation) is timed
apart. ``$EMULATE=0`` lets Inductor keep bf16 intermediates in float32 (fewer roundings than eager).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/rollout/compiled_decode.py --dtype bfloat16 --repeats 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

PACKS: list[tuple] = []  # (pack, bias) by index, refreshed when the engine repacks


@torch.library.custom_op("posttrain_bench::packed_linear", mutates_args=())
def packed(x: Tensor, index: int, out_features: int) -> Tensor:
    pack, bias = PACKS[index]
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


@packed.register_fake
def _(x, index, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("posttrain_bench::cache_write", mutates_args=("buf",))
def cache_write(buf: Tensor, x: Tensor, start: int) -> None:
    buf[:, :, start:start + x.shape[2]].copy_(x)


@cache_write.register_fake
def _(buf, x, start):
    return None


def register(pack_bias: tuple) -> tuple[int, int]:
    PACKS.append(pack_bias)
    return len(PACKS) - 1, pack_bias[0].shape[0]


def layer_specs(model, layers, head_pack) -> tuple[list[SimpleNamespace], tuple[int, int]]:
    """The packs of ``layers`` (``lean_forward.plan``) and the head's put in :data:`PACKS` (same order
    every time, so a compiled step's constant indices stay right after a repack)."""
    PACKS.clear()
    head = register((head_pack, None))
    specs = [SimpleNamespace(qkv=register(lay.qkv), o=register(lay.o), gate_up=register(lay.gate_up),
                             down=register(lay.down), input_norm=block.input_layernorm,
                             post_norm=block.post_attention_layernorm, q_heads=lay.q_heads, kv_heads=lay.kv_heads,
                             dim=lay.dim, scaling=lay.scaling)
             for lay, block in zip(layers, model.model.layers)]
    return specs, head


def decode_step(model, specs, head):
    """The lean forward's one-query step as one function of tensors (for ``torch.compile``)."""
    inner = model.model
    ops = torch.ops.posttrain_bench

    def step(ids, positions, attn_mask, keys, values, length: int):
        rows = ids.shape[0]
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden, positions)
        cos, sin = cos[:, None], sin[:, None]
        half = sin.shape[-1] // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        for i, s in enumerate(specs):
            qkv = ops.packed_linear(s.input_norm(hidden), *s.qkv)
            qk, v = (part.view(rows, 1, -1, s.dim)
                     for part in qkv.split([(s.q_heads + s.kv_heads) * s.dim, s.kv_heads * s.dim], dim=-1))
            qk = qk.transpose(1, 2)
            q, k = (qk * cos + qk.roll(half, -1) * signed_sin).split([s.q_heads, s.kv_heads], dim=1)
            ops.cache_write(keys[i], k, length)
            ops.cache_write(values[i], v.transpose(1, 2), length)
            out = F.scaled_dot_product_attention(q.reshape(rows, s.kv_heads, -1, s.dim), keys[i][:, :, :length + 1],
                                                 values[i][:, :, :length + 1], attn_mask=attn_mask, scale=s.scaling)
            hidden = hidden + ops.packed_linear(out.reshape(rows, -1, 1, s.dim).transpose(1, 2).reshape(rows, 1, -1),
                                                *s.o)
            gate, up = ops.packed_linear(s.post_norm(hidden), *s.gate_up).chunk(2, -1)
            hidden = hidden + ops.packed_linear(F.silu(gate) * up, *s.down)
        return ops.packed_linear(inner.norm(hidden), *head)

    return step


class CompiledLeanForward(SimpleNamespace):
    """``lean_forward`` with its decode steps compiled (swapped into ``rollout.native`` by :func:`run`)."""

    def __init__(self, engine):
        from posttrain.models import lean_forward

        super().__init__(**{k: getattr(lean_forward, k) for k in dir(lean_forward)
                            if not k.startswith("__") and k != "forward"})  # the module's own, kept as ``eager``
        self.eager, self.engine, self.compiled, self.layers_id, self.calls = lean_forward.forward, engine, None, None, 0

    def forward(self, model, layers, ids, mask, positions, cache, keep):
        cached = cache.layers
        if ids.shape[1] != 1 or any(layer.length + 1 > layer.capacity for layer in cached):
            return self.eager(model, layers, ids, mask, positions, cache, keep)
        if self.layers_id != id(layers):  # repacked
            specs, head = layer_specs(model, layers, self.engine._packs.packs[model.lm_head])
            self.layers_id = id(layers)
            if self.compiled is None:
                self.compiled = torch.compile(decode_step(model, specs, head), dynamic=True)
        length = cached[0].length
        out = self.compiled(ids, positions, self._attention_mask(mask, 1, model.lm_head.weight.dtype),
                            [layer.key_buf for layer in cached], [layer.value_buf for layer in cached], length)
        for layer in cached:
            layer.length = length + 1
            layer._refresh_views()
        self.calls += 1
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    inductor_config.emulate_precision_casts = os.environ.get("EMULATE", "1") == "1"
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from bench_rollout import _smollm2_instruct, chat_prompts
    from decode_speed import machine
    from posttrain.demo.pretrained import ensure_smollm2
    from posttrain.host_memory import keep_freed_memory
    from posttrain.models import lean_forward
    from posttrain.models.cpu_linear import use_cpu_linear
    from posttrain.rollout import native
    from posttrain.rollout.base import SamplingParams

    model = _smollm2_instruct().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    prompts, sp = chat_prompts(8), SamplingParams(max_tokens=64, seed=1, temperature=0.5, top_k=-1)
    common = dict(pad_token_id=tokenizer.pad_token_id or 0, eos_token_ids=[tokenizer.eos_token_id], dtype=args.dtype)
    engines = {name: native.NativeEngine(model, packed_weights=True, **common) for name in ("eager", "compiled")}
    forwards = {"eager": lean_forward, "compiled": CompiledLeanForward(engines["compiled"])}

    def run(name):
        native.lean_forward = forwards[name]
        try:
            engines[name]._packs.clear()  # as after an update: the packing is part of each call
            start = time.perf_counter()
            out = engines[name].generate(prompts, 8, sp)
            return out, time.perf_counter() - start
        finally:
            native.lean_forward = lean_forward

    print(machine(), flush=True)
    with use_cpu_linear("blas"), keep_freed_memory("cpu"):
        first = {name: run(name) for name in engines}
        print("first call s:", {name: round(t, 1) for name, (_, t) in first.items()}, flush=True)
        (a, _), (b, _) = first["eager"], first["compiled"]
        tokens = [[o.token_ids for o in g] for g in a], [[o.token_ids for o in g] for g in b]
        counts = [sum(len(t) for g in side for t in g) for side in tokens]
        print("same tokens:", tokens[0] == tokens[1], "tokens:", counts)
        times = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name in (list(engines) if repeat % 2 == 0 else list(engines)[::-1]):
                times[name].append(run(name)[1])
            print({name: round(t[-1], 2) for name, t in times.items()}, Path("/proc/loadavg").read_text().strip(),
                  flush=True)
    ratio = statistics.median(x / y for x, y in zip(times["eager"], times["compiled"]))
    print("median eager / compiled:", round(ratio, 3), "compiled steps:", forwards["compiled"].calls)


if __name__ == "__main__":
    os.environ.setdefault("POSTTRAIN_ROLLOUT_PACKED", "off")  # each engine says what it uses
    main()
