#!/usr/bin/env bash
# The whole pipeline on a ~10M-parameter Qwen2, in a few minutes on a CPU:
# init-model -> data -> preprocess -> SFT warm start -> GRPO -> eval.
# Usage: bash examples/tiny/run_pipeline.sh [OUT_DIR]   (default runs/tiny)
set -euo pipefail
OUT=${1:-runs/tiny}
PY=${PYTHON:-python3}
PT=${POSTTRAIN:-"$PY -m posttrain"}

$PT init-model --model tiny_qwen2 --output "$OUT/model" --seed 1234
"$PY" "$(dirname "$0")/make_data.py" "$OUT/raw"
$PT preprocess --config-name tiny_add_sft input="$OUT/raw/sft.jsonl" tokenizer_name_or_path="$OUT/model" \
    output_prefix="$OUT/data/sft/data"
$PT preprocess --config-name tiny_add input="$OUT/raw/train.jsonl" tokenizer_name_or_path="$OUT/model" \
    output_prefix="$OUT/data/rl/data"
$PT preprocess --config-name tiny_add input="$OUT/raw/test.jsonl" tokenizer_name_or_path="$OUT/model" \
    output_prefix="$OUT/data/test/data"
$PT train --config-name sft_tiny_qwen2 megatron_training.tokenizer_name_or_path="$OUT/model" \
    megatron_training.data_path="$OUT/data/sft/data" megatron_training.save="$OUT/sft_ckpt" \
    rl_config.output_dir="$OUT/sft"
$PT train --config-name grpo_tiny_qwen2 megatron_training.tokenizer_name_or_path="$OUT/model" \
    megatron_training.data_path="$OUT/data/rl/data" actor_config.load="$OUT/sft_ckpt" \
    actor_config.save="$OUT/grpo_ckpt" rl_config.output_dir="$OUT/grpo" \
    rl_config.eval_data_path="$OUT/data/test/data"
$PT eval --model "$OUT/grpo_ckpt" --data "$OUT/data/test/data" --verifier last_number \
    --max-tokens 8 --output "$OUT/eval.json"
