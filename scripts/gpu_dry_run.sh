#!/usr/bin/env bash
# `make gpu-dry-run`: the GPU machine's procedure rehearsed here, so that a device call is not where it first breaks.
# First the plan `make gpu-check` follows on a GPU (each section's estimated seconds; GPU_CHECK_ARGS as there).
# The carried set (`make gpu-wheels`: wheels for the image's CPython 3.12, their requirements checked for 3.12's
# markers and tags), what a call carries against its 64 MiB, then a fresh venv that sees only the image's packages
# (links to the .venv's torch, numpy, ...: scripts/gpu_wheels.py image) and, with the network cut (unshare -n where
# it can be), installs the wheels from their folder alone through scripts/gpu-python.sh and runs the whole check on
# the CPU at its quick sizes. This machine's CPython is not 3.12, which cannot load the 3.12 set's compiled wheels:
# the run uses the same pins downloaded for this interpreter (the 3.12 interpreter itself stays unproven here).
set -euo pipefail
cd "$(dirname "$0")/.."
host=${HOST_PYTHON:-.venv/bin/python}
base=${BASE_PYTHON:-python3}
here=${TULA_DRY_RUN_DIR:-/tmp/tula-gpu-dry-run}
rm -rf "$here" && mkdir -p "$here"

# The default preset's plan on a GPU: each section's estimate from the seconds recorded on one (bench/gpu_plan.py).
"$host" bench/gpu_check.py --plan ${GPU_CHECK_ARGS:-}
"$host" scripts/gpu_wheels.py download
"$host" scripts/gpu_wheels.py size
version=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wheels=.whl
if [ "$version" != 3.12 ]; then
    wheels=$here/wheels-$version
    echo "gpu-dry-run: CPython $version here, not 3.12: the same pins for $version into $wheels"
    "$host" scripts/gpu_wheels.py download --python "$version" --wheels "$wheels"
fi

"$host" scripts/gpu_wheels.py image --into "$here/image"
"$base" -m venv "$here/venv"
site_packages=$("$here/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$here/image" >"$site_packages/gpu-image.pth"

offline=()
if unshare -rn true 2>/dev/null; then
    offline=(unshare -rn)
else
    echo "gpu-dry-run: unshare -n is not allowed here: offline only by pip's --no-index" >&2
fi
PYTHON=$here/venv/bin/python TULA_GPU_WHEELS=$wheels TULA_GPU_SITE=$here/site PIP_NO_INDEX=1 \
    "${offline[@]}" bash scripts/gpu-python.sh bench/gpu_check.py --device cpu --scale quick \
    --out "$here/gpu_check.json" --work-dir "$here/work" ${GPU_DRY_RUN_ARGS:-}
echo "gpu-dry-run: passed ($here/gpu_check.json)"
