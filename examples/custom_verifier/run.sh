#!/usr/bin/env bash
# Score data.jsonl with the example verifiers and a built-in one (run from anywhere).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
posttrain score --verifier-module my_rewards \
  --verifier word_answer --verifier short_and_correct --verifier math_equiv \
  --input "$here/data.jsonl" --output "${1:-/tmp/custom_verifier_scores.jsonl}"
