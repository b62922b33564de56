#!/usr/bin/env bash
# PPO, DAPO and DPO on the tiny task, each from the SFT warm start of run_pipeline.sh.
# Run examples/tiny/run_pipeline.sh OUT first (it makes OUT/model, OUT/raw, OUT/data and OUT/sft_ckpt).
# Usage: bash examples/tiny/run_algorithms.sh OUT [ppo] [dapo] [dpo]   (default: all three)
# Each leg writes OUT/<leg>/ (metrics.jsonl, TensorBoard, and the greedy held-out accuracy: eval.jsonl
# before and after for PPO and DAPO, eval.json after for DPO) and OUT/<leg>_ckpt.
set -euo pipefail
OUT=${1:?usage: run_algorithms.sh OUT [ppo] [dapo] [dpo]}
shift
LEGS=${*:-ppo dapo dpo}
PY=${PYTHON:-python3}
PT=${POSTTRAIN:-"$PY -m posttrain"}

if [ ! -d "$OUT/sft_ckpt" ]; then
    echo "error: $OUT/sft_ckpt not found: run 'bash examples/tiny/run_pipeline.sh $OUT' first" >&2
    exit 2
fi

on_policy() {  # PPO / DAPO: the RL prompts of the pipeline, eval on its test problems
    $PT train --config-name "$1_tiny_qwen2" megatron_training.tokenizer_name_or_path="$OUT/model" \
        megatron_training.data_path="$OUT/data/rl/data" actor_config.load="$OUT/sft_ckpt" \
        actor_config.save="$OUT/$1_ckpt" rl_config.output_dir="$OUT/$1" \
        rl_config.eval_data_path="$OUT/data/test/data"
}

for leg in $LEGS; do
    case $leg in
        ppo|dapo) on_policy "$leg" ;;
        dpo)
            "$PY" "$(dirname "$0")/make_pairs.py" "$OUT/raw"
            $PT preprocess --config-name tiny_add_pairs input="$OUT/raw/pairs.jsonl" \
                tokenizer_name_or_path="$OUT/model" output_prefix="$OUT/data/pairs/data"
            $PT train --config-name dpo_tiny_qwen2 megatron_training.tokenizer_name_or_path="$OUT/model" \
                megatron_training.data_path="$OUT/data/pairs/data" megatron_training.load="$OUT/sft_ckpt" \
                megatron_training.save="$OUT/dpo_ckpt" rl_config.output_dir="$OUT/dpo"
            $PT eval --model "$OUT/dpo_ckpt" --data "$OUT/data/test/data" --verifier last_number \
                --max-tokens 8 --output "$OUT/dpo/eval.json" ;;
        *) echo "error: unknown leg '$leg' (known: ppo dapo dpo)" >&2; exit 2 ;;
    esac
done
