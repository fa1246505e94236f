#!/usr/bin/env bash
# python3 with what the repository needs where there is no .venv: the GPU machine, whose python3 holds torch (the
# image's build, never the lock's pin) but not Snakemake, submitit, kneed or jsonschema, and which reaches neither
# a package index nor Debian's archive. The wheels `make gpu-wheels` put in .whl/ are installed into a folder on
# PYTHONPATH with the repository (tula_hpc without an install), a `tula-hpc` command on PATH runs the stages for
# Snakemake's rules, and Fashion-MNIST's files that `make gpu-data` put in .data/fashion-mnist/ go where Debian's
# package puts them when they are not there yet. Arguments are python3's. Run by `make gpu-check` and
# `make gpu-generalization`, and here by `make gpu-dry-run` (PYTHON: a venv standing in for the image, TULA_GPU_WHEELS:
# wheels for its CPython); also usable alone: bash scripts/gpu-python.sh bench/gpu_check.py --sections memory
set -euo pipefail
# The call's start: bench/gpu_check.py counts the setup below in the slot (its run.setup_s).
export TULA_GPU_CALL_STARTED=${TULA_GPU_CALL_STARTED:-$(date +%s.%N)}
cd "$(dirname "$0")/.."
repo=$PWD
python=$(command -v "${PYTHON:-python3}")
site=${TULA_GPU_SITE:-/tmp/tula-gpu-site}
wheels=${TULA_GPU_WHEELS:-.whl}
carried_data=.data/fashion-mnist

if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
else
    echo "gpu-python: no wheels in $wheels/ (make gpu-wheels, then carry .whl): using $python's own packages" >&2
    mkdir -p "$site"
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
# Bytecode once, here, in parallel: every stage is a fresh Python that otherwise compiles what it imports again
# (issue 39: light stages spent 3-5 s importing on the H200 against 0.1-1 s here), and its bytecode is kept.
unset PYTHONDONTWRITEBYTECODE
"$python" -m compileall -q -j 0 "$site" "$repo/tula_hpc" "$repo/bench" >/dev/null ||
    echo "gpu-python: compileall left some files uncompiled; they compile as they are imported" >&2
mkdir -p "$site/bin"
printf '#!/bin/sh\nexec "%s" -m tula_hpc.cli "$@"\n' "$python" >"$site/bin/tula-hpc"
chmod +x "$site/bin/tula-hpc"
export PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1
# The carried packages' needs against what this Python has: warnings only, the image's versions being unknown here.
"$python" scripts/gpu_wheels.py check --site "$site" || true

if compgen -G "$carried_data/*.gz" >/dev/null; then
    folder=$("$python" -c 'from tula_hpc.training.data_check import FASHION_MNIST_FOLDER; print(FASHION_MNIST_FOLDER)')
    if ! compgen -G "$folder/*.gz" >/dev/null; then
        mkdir -p "$folder" && cp "$carried_data"/*.gz "$folder"/ && echo "gpu-python: Fashion-MNIST's files copied to $folder" >&2
    fi
fi
exec "$python" "$@"
