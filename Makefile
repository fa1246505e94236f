# Every target creates .venv on first use (pip only: torch/torchvision wheels come from the local disk).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint slurm-up slurm-down clean

$(STAMP): pyproject.toml envs/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r envs/requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tula-hpc unlock-stale
	$(BIN)/snakemake --profile profiles/local

test: $(STAMP)
	$(BIN)/python -m pytest -ra tests

lint: $(STAMP)
	$(BIN)/snakemake --lint

slurm-up:
	bash scripts/slurm/up.sh

slurm-down:
	bash scripts/slurm/down.sh

clean:
	rm -rf results work .snakemake
