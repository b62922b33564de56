#!/usr/bin/env bash
# The GPU device check: one command on a machine with one CUDA GPU and PyTorch (with transformers,
# which the GPU images have). About 4 minutes on an H200; at most 8.
#
#   bash benchmarks/gpu/device_check.sh [--dry-run] [--with-7b] [--out DIR]
#
# 1. installs the wheels in .whl/ (if any) into /tmp/site: the Python packages posttrain needs that
#    the GPU image lacks. Download them here, where pip reaches PyPI (about 3 MiB; the limit is 60):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#        pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
#    (pydantic reads the configs; math-verify is needed only by the math verifiers, which the
#    check does not use). Match pydantic-core to the pydantic release's pin.
# 2. runs the gpu-marked tests (the native engine on CUDA, offload, the Megatron backend, vLLM if
#    installed), and records their outcome; with vLLM installed (a CUDA vllm wheel carried in .whl/,
#    or on the image) also tests/vllm: the adapter against the real vLLM on the GPU (weight sync,
#    the sync probe, the prefix cache, GRPO loops with vLLM rollout; Ray tests skip without ray);
# 3. runs benchmarks/gpu/device_check.py: the bf16 matmul peak, rollout tokens/s against Hugging
#    Face generate, rollout-vs-trainer and CPU-vs-GPU log-probs, and 3 GRPO iterations of the real
#    trainer on a random-init model shaped like Qwen2.5-0.5B (MFU, tokens/s, peak memory);
# 4. writes DIR/device_check.json and DIR/device_check.md (DIR: --out, else $OUT, else
#    runs/device_check) and DIR/gpu_tests.log.
#
# --dry-run runs the same steps on the CPU with a tiny model (the gpu tests then skip).
# The exit status is 0 only when every test passed and every section produced its numbers.
set -uo pipefail

cd "$(dirname "$0")/../.."
DRY="" ; EXTRA=() ; OUT_DIR="${OUT:-runs/device_check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY="--dry-run" ;;
    --with-7b) EXTRA+=("--with-7b") ;;
    --out) shift; OUT_DIR="$1" ;;
    *) echo "device_check.sh: unknown argument $1 (use --dry-run, --with-7b, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT_DIR"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if [ -z "$DRY" ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_check.sh: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch, transformers, pydantic" \
  || { echo "device_check.sh: needs torch, transformers and pydantic (see the wheels above)" >&2; exit 2; }
[ -z "$DRY" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== gpu-marked tests"
TESTS=(tests/gpu tests/unit/rollout/test_vllm_engine.py)
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT_DIR/gpu_tests.xml" "${TESTS[@]}" \
  2>&1 | tee "$OUT_DIR/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
[ "$TESTS_RC" -eq 5 ] && TESTS_RC=0  # pytest's "no tests ran" (all skipped on a CPU) is not a failure

echo "== vLLM tests (tests/vllm)"
if [ -z "$DRY" ] && "$PYTHON" -c "import vllm" 2>/dev/null; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -p no:logging --junitxml="$OUT_DIR/vllm_tests.xml" tests/vllm \
    2>&1 | tail -n 40 | tee "$OUT_DIR/vllm_tests.log"
  VLLM_RC=${PIPESTATUS[0]}
  [ "$VLLM_RC" -eq 5 ] && VLLM_RC=0
  [ "$VLLM_RC" -ne 0 ] && TESTS_RC=$VLLM_RC
else
  echo "skipped: vllm is not importable here (carry a CUDA vllm wheel in .whl/ to run them)" | tee "$OUT_DIR/vllm_tests.log"
fi

echo "== measurements"
"$PYTHON" benchmarks/gpu/device_check.py $DRY "${EXTRA[@]}" --out "$OUT_DIR" --tests "$OUT_DIR/gpu_tests.xml"
CHECK_RC=$?

echo "device check: tests exit $TESTS_RC, measurements exit $CHECK_RC; results in $OUT_DIR"
[ "$TESTS_RC" -eq 0 ] && [ "$CHECK_RC" -eq 0 ]
