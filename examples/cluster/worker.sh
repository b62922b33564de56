#!/usr/bin/env bash
# Multi-node launch, worker side: join the Ray cluster whose head runs on MASTER_ADDR, and stay
# (the master's trainer places actor workers here). Stop with: .venv/bin/ray stop
#
#   MASTER_ADDR=10.0.0.1 DEVICES_PER_NODE=8 bash examples/cluster/worker.sh
#
# Environment: MASTER_ADDR (required), RAY_PORT (the head's port, default 6766), VENV (default
# .venv), DEVICES_PER_NODE (without GPUs: the CPU worker processes this node offers), RAY_START_ARGS
# (more `ray start` options: a second node on the same machine needs its own --temp-dir and ports,
# e.g. --node-manager-port, --object-manager-port, --min/max-worker-port, the agents' ports).
set -euo pipefail
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the head node IP}
PORT=${RAY_PORT:-6766}
VENV=${VENV:-.venv}
read -r -a EXTRA <<< "${RAY_START_ARGS:-}"
if [ -n "${DEVICES_PER_NODE:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  CPUS=(--num-cpus "$DEVICES_PER_NODE")
else
  CPUS=()
fi
# the head (Ray >= 2.5x) uses token authentication when a token exists; `ray start --address` does not
# switch it on by itself, so do what the head did
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi
"$VENV/bin/ray" start --address "$MASTER_ADDR:$PORT" "${CPUS[@]}" "${EXTRA[@]}" --disable-usage-stats
echo "joined the Ray cluster at $MASTER_ADDR:$PORT"
