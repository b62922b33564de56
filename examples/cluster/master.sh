#!/usr/bin/env bash
# Multi-node launch, master side: start the Ray head, wait until NNODES nodes have joined, then
# run the trainer on this node (the driver). Every node needs the same paths (repository, venv,
# model, data, save dir) -- as the seed requires.
#
#   NNODES=2 DEVICES_PER_NODE=8 bash examples/cluster/master.sh grpo_tiny_qwen2 rl_config.actor_resource.num_npus=16
#
# Then on every other node:  MASTER_ADDR=<this node's IP> bash examples/cluster/worker.sh
#
# Environment (all optional):
#   NNODES            nodes to wait for, this one included (default 1)
#   DEVICES_PER_NODE  without GPUs: the CPU worker processes this node offers (default: Ray's CPU count)
#   RAY_PORT          the head's port (GCS), which worker.sh joins (default 6766)
#   VENV              the virtual environment with posttrain and ray (default .venv)
#   WAIT_TIMEOUT_S    how long to wait for the nodes (default 600)
#   RAY_START_ARGS    more `ray start` options, e.g. "--temp-dir=/scratch/ray --dashboard-port=8266"
#                     (several Ray clusters on one machine need their own ports and temp dirs)
# The head stays up after the run; stop it with `$VENV/bin/ray stop` (which stops every Ray process
# on this machine).
set -euo pipefail
CONFIG=${1:?usage: master.sh CONFIG_NAME [--config-path DIR] [overrides...]}
shift
NNODES=${NNODES:-1}
PORT=${RAY_PORT:-6766}
VENV=${VENV:-.venv}
TIMEOUT=${WAIT_TIMEOUT_S:-600}
RAY="$VENV/bin/ray"
read -r -a EXTRA <<< "${RAY_START_ARGS:-}"

# DEVICES_PER_NODE: GPUs (Ray detects them) or, without accelerators, CPU worker processes
if [ -n "${DEVICES_PER_NODE:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  CPUS=(--num-cpus "$DEVICES_PER_NODE")
else
  CPUS=()
fi
# Ray >= 2.5x turns on token authentication on the head when a token exists (~/.ray/auth_token), but
# a client joining it (the wait below, the trainer, worker.sh) must ask for it: copy the token to every
# node (or set RAY_AUTH_MODE=disabled everywhere)
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi
"$RAY" start --head --port "$PORT" "${CPUS[@]}" "${EXTRA[@]}" --disable-usage-stats

echo "waiting for $NNODES node(s) to join the Ray cluster (port $PORT)..."
deadline=$((SECONDS + TIMEOUT))
while true; do
  alive=$("$VENV/bin/python" -c "import ray; ray.init(address='127.0.0.1:$PORT', logging_level='ERROR'); \
print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
  echo "  $alive / $NNODES nodes"
  [ "$alive" -ge "$NNODES" ] && break
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "only $alive of $NNODES nodes joined within ${TIMEOUT}s; check worker.sh on the other nodes" >&2
    exit 1
  fi
  sleep 5
done

# the driver joins this head through RAY_ADDRESS (rl_config.ray_address=127.0.0.1:$PORT says the same)
RAY_ADDRESS="127.0.0.1:$PORT" "$VENV/bin/posttrain" train --config-name "$CONFIG" "$@"
