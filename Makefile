# Every target creates .venv on first use from the exact lock envs/requirements.txt (pip only: torch/torchvision
# wheels come from the local disk); pyproject.toml declares ranges, for installs on a cluster's own torch.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-slurm slurm-up slurm-down clean

$(STAMP): pyproject.toml envs/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r envs/requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	$(BIN)/pip check  # the lock must satisfy the ranges pyproject.toml declares
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tula-hpc unlock-stale
	$(BIN)/snakemake --profile profiles/local

test: $(STAMP)
	$(BIN)/python -m pytest -ra tests

# ruff (lint and format), snakefmt and Snakemake's own lint; pinned in envs/requirements.txt.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

bench-slurm: $(STAMP)
	$(BIN)/python bench/slurm_overhead.py

# The Slurm tests start the cluster when it is not up, and then stop it (root needed); these targets are for people.
slurm-up:
	bash scripts/slurm/up.sh

slurm-down:
	bash scripts/slurm/down.sh

# Keeps work/slurm (the local cluster's state); `make slurm-down` first to stop the cluster.
clean:
	rm -rf results logs .snakemake
	find work -mindepth 1 -maxdepth 1 ! -name slurm -exec rm -rf {} + 2>/dev/null || true
