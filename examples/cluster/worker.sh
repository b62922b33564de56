#!/usr/bin/env bash
# Multi-node launch, worker side: join the Ray cluster whose head runs on MASTER_ADDR, and stay
# (the master's trainer places actor workers here). Stop with: .venv/bin/ray stop
#
#   MASTER_ADDR=10.0.0.1 DEVICES_PER_NODE=8 bash examples/cluster/worker.sh
set -euo pipefail
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the head node IP}
PORT=${RAY_PORT:-6766}
VENV=${VENV:-.venv}
if [ -n "${DEVICES_PER_NODE:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  CPUS=(--num-cpus "$DEVICES_PER_NODE")
else
  CPUS=()
fi
"$VENV/bin/ray" start --address "$MASTER_ADDR:$PORT" "${CPUS[@]}" --disable-usage-stats
echo "joined the Ray cluster at $MASTER_ADDR:$PORT"
