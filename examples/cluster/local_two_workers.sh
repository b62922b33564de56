#!/usr/bin/env bash
# One machine, no accelerator: GRPO on the tiny Qwen2 with 2 Ray CPU actor workers; the trainer
# starts and stops a local Ray cluster. Run examples/tiny/run_pipeline.sh first (it makes runs/tiny/).
# Same loop, and the same update as 1 process on the same global batch (docs/cluster.md).
#
#   bash examples/cluster/local_two_workers.sh [more overrides...]
set -euo pipefail
VENV=${VENV:-.venv}
"$VENV/bin/posttrain" train --config-name grpo_tiny_qwen2 rl_config.actor_resource.num_npus=2 "$@"
