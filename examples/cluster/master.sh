#!/usr/bin/env bash
# Multi-node launch, master side: start the Ray head, wait until NNODES nodes have joined, then
# run the trainer on this node (the driver). Every node needs the same paths (repository, venv,
# model, data, save dir) -- as the seed requires.
#
#   NNODES=2 DEVICES_PER_NODE=8 bash examples/cluster/master.sh grpo_tiny_qwen2 rl_config.actor_resource.num_npus=16
#
# Then on every other node:  MASTER_ADDR=<this node's IP> bash examples/cluster/worker.sh
set -euo pipefail
CONFIG=${1:?usage: master.sh CONFIG_NAME [overrides...]}
shift
NNODES=${NNODES:-1}
PORT=${RAY_PORT:-6766}
VENV=${VENV:-.venv}
TIMEOUT=${WAIT_TIMEOUT_S:-600}
RAY="$VENV/bin/ray"

# DEVICES_PER_NODE: GPUs (Ray detects them) or, without accelerators, CPU worker processes
if [ -n "${DEVICES_PER_NODE:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  CPUS=(--num-cpus "$DEVICES_PER_NODE")
else
  CPUS=()
fi
"$RAY" start --head --port "$PORT" "${CPUS[@]}" --disable-usage-stats

echo "waiting for $NNODES node(s) to join the Ray cluster (port $PORT)..."
deadline=$((SECONDS + TIMEOUT))
while true; do
  alive=$("$VENV/bin/python" -c "import ray; ray.init(address='auto', logging_level='ERROR'); \
print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
  echo "  $alive / $NNODES nodes"
  [ "$alive" -ge "$NNODES" ] && break
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "only $alive of $NNODES nodes joined within ${TIMEOUT}s; check worker.sh on the other nodes" >&2
    exit 1
  fi
  sleep 5
done

# the driver connects to this head (rl_config.ray_address could say the same)
RAY_ADDRESS="127.0.0.1:$PORT" "$VENV/bin/posttrain" train --config-name "$CONFIG" "$@"
