#!/usr/bin/env bash
# bench/gpu_check.py where there is no .venv: the GPU machine, whose python3 holds torch (the image's build, never
# the lock's pin) but not Snakemake, submitit, kneed or jsonschema, and which reaches no network. The wheels that
# `make gpu-wheels` put in .whl/ are installed into a folder on PYTHONPATH with the repository (tula_hpc without
# an install), and a `tula-hpc` command on PATH runs the stages for Snakemake's rules. Arguments go to
# bench/gpu_check.py. Run by `make gpu-check`; also usable alone: bash scripts/gpu-check.sh --sections memory
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=$(command -v "${PYTHON:-python3}")
site=${TULA_GPU_SITE:-/tmp/tula-gpu-site}
wheels=${TULA_GPU_WHEELS:-.whl}

if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
else
    echo "gpu-check: no wheels in $wheels/ (make gpu-wheels, then carry .whl): using $python's own packages" >&2
    mkdir -p "$site"
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$site/bin"
printf '#!/bin/sh\nexec "%s" -m tula_hpc.cli "$@"\n' "$python" >"$site/bin/tula-hpc"
chmod +x "$site/bin/tula-hpc"
export PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1
# The carried packages' needs against what this Python has: warnings only, the image's versions being unknown here.
"$python" scripts/gpu_wheels.py check --site "$site" || true
exec "$python" bench/gpu_check.py "$@"
