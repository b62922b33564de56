#!/usr/bin/env bash
# Preprocess one dataset config: bash examples/data/preprocess_data.sh NAME [key=value ...]
# reads configs/datasets/NAME.yaml; extra arguments are overrides, e.g. input=... workers=4
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash $0 NAME [key=value ...]   (NAME: a file in configs/datasets/, without .yaml)" >&2
    exit 2
fi
name="$1"
shift
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
if command -v posttrain >/dev/null 2>&1; then
    exec posttrain preprocess --config-name "$name" "$@"
fi
exec "${PYTHON:-python}" -m posttrain preprocess --config-name "$name" "$@"
