"""`make gpu-dry-run` (scripts/gpu_dry_run.sh): the GPU machine's procedure rehearsed here, from the default preset's
plan and the wheels to a result file. Needs the package index for the wheels (as `make gpu-wheels` does); the run
itself is offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_the_wheels_install_offline_on_the_images_packages_alone_and_the_whole_check_runs(tmp_path):
    reachable = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(tmp_path / "probe"), "kneed"],
        capture_output=True,
        timeout=120,
    )
    if reachable.returncode != 0:
        pytest.skip("no package index: the dry run starts from `make gpu-wheels`")
    env = {**os.environ, "TULA_DRY_RUN_DIR": str(tmp_path / "dry"), "HOST_PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_dry_run.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("plan on cuda") and "dag" in proc.stdout.split("\n\n")[0]  # the default's plan
    assert "a device call carries" in proc.stdout and "for CPython 3.12" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"gpu-dry-run: passed ({tmp_path / 'dry' / 'gpu_check.json'})")
    result = json.loads((tmp_path / "dry" / "gpu_check.json").read_text())
    assert result["complete"] and not [name for name, s in result["sections"].items() if "error" in s]
    # The run's packages came from the wheels and the image's stand-in, never from the .venv.
    site = {path.name for path in (tmp_path / "dry" / "site").iterdir()}
    assert {"snakemake", "submitit", "kneed", "jsonschema"} <= site
