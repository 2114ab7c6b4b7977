# qerl: one command per job. Every target installs what it needs first (see `deps`).
PY ?= python3
SCALE ?= smoke
PYTEST_ARGS ?=
export PYTHONUNBUFFERED := 1

.PHONY: deps test test-gpu lint quant-report
.DEFAULT_GOAL := help

help:
	@echo "make test                 run the CPU test suite (installs dependencies first)"
	@echo "make test-gpu             run the GPU tests (-m gpu) on a CUDA host"
	@echo "make reproduce-table2     Table 2 at SCALE=$(SCALE) (smoke|toy|paper)"
	@echo "make quant-report         bits/weight and quantization error of every format"

# A CPU-only machine gets the local CPU wheel of torch 2.13.0; an existing torch (e.g. CUDA) is left alone.
deps:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -m pip install -q -e ".[dev,kernels]"

test: deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-gpu: deps
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

lint: deps
	$(PY) -m ruff check qerl experiments sweeps paper_figures tests

quant-report: deps
	$(PY) -m qerl.quant.report
