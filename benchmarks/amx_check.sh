#!/usr/bin/env bash
# bf16 on a CPU with AMX tiles (issue 43): one command on a machine whose CPU has them (the GPU device
# machine's host, say), run from the repository root with PyTorch and transformers installed.
#
#   bash benchmarks/amx_check.sh SMOLLM2_FILES OUT_DIR [CORES]
#
# SMOLLM2_FILES: SmolLM2-135M-Instruct's config.json, tokenizer and chat template (no weights: about
# 4 MB, copied from posttrain's model cache). A model of that shape with random weights is written
# into a fresh model cache, so the chat workload (benchmarks/vs_trl/common.py) runs with posttrain's
# own data, reward and settings; random weights never stop early, so every answer runs its 64 tokens
# (the real model's stop earlier): the step is longer than with the real weights, alike in both
# precisions. CORES (default 0,1): the cores the measurements are pinned to, as on a 2-core laptop.
#
# Writes OUT_DIR/amx_check.log: the CPU (lscpu, torch's AMX probe, posttrain's precision choice), the
# matmul peak in fp32 and bf16 at 1 and 2 threads with SmolLM2's update shapes, the attention kernels
# in bf16, and OUT_DIR/floor_gap_{fp32,bf16}.json: benchmarks/floor_gap.py's step against its floor
# in each precision (2 threads, one round).
set -uo pipefail
cd "$(dirname "$0")/.."
FILES=${1:?usage: amx_check.sh SMOLLM2_FILES OUT_DIR [CORES]}
OUT_DIR=${2:?usage: amx_check.sh SMOLLM2_FILES OUT_DIR [CORES]}
CORES=${3:-0,1}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/amx_check.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export POSTTRAIN_MODEL_CACHE="${TMPDIR:-/tmp}/amx_check_models"
WORK="${TMPDIR:-/tmp}/amx_check_work"
PIN=(taskset -c "$CORES")

{
  echo "== cpu"
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket|L2|L3'
  grep -o -w -E 'amx_bf16|amx_tile|amx_int8|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort | uniq -c
  "$PYTHON" - <<'EOF' || exit 1
import torch
from posttrain.device import cpu_supports_bf16, precision
from posttrain.models import cpu_attention
print("torch", torch.__version__, "| AMX tiles:", torch.cpu._is_amx_tile_supported(),
      "| posttrain: cpu bf16 =", cpu_supports_bf16(), "| precision(cpu, bf16 asked) =",
      precision("cpu", bf16=True, rollout_dtype="bfloat16"),
      "| bf16 attention in fp32 =", cpu_attention.bf16_in_fp32())
EOF
  echo "== random-init SmolLM2-135M at $POSTTRAIN_MODEL_CACHE"
  "$PYTHON" - "$FILES" <<'EOF' || exit 1
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from posttrain.demo.pretrained import default_cache_dir
target = default_cache_dir() / "SmolLM2-135M-Instruct"
if not (target / "model.safetensors").exists():
    shutil.copytree(sys.argv[1], target, dirs_exist_ok=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target)).save_pretrained(target)
print(sorted(p.name for p in target.iterdir()))
EOF
  echo "== matmul peak (pinned to cores $CORES)"
  "${PIN[@]}" "$PYTHON" benchmarks/matmul_peak.py --threads 1 2 --seconds 1 --tokens 1136
  echo "== attention kernels, bf16, 1 thread"
  OMP_NUM_THREADS=1 "${PIN[@]}" "$PYTHON" benchmarks/attention_kernels.py --repeats 5 --only update --dtypes bfloat16
  for precision in fp32 bf16; do
    echo "== floor_gap $precision, 2 threads"
    "${PIN[@]}" "$PYTHON" benchmarks/floor_gap.py --compare --size chat --precision "$precision" --rounds 1 \
      --variants after --threads 2 --work "$WORK" --output "$OUT_DIR/floor_gap_$precision.json"
  done
} 2>&1 | tee "$LOG"
