"""Adaptive search inside the real DAG: extra profiles land one by one, and a rerun reuses them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import snakemake_command, tiny_job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TARGET = "results/digits-cnn/perfmodel.json"


def snakemake_until_the_model(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        snakemake_command(workdir, "local", workdir / "jobs.yaml", TARGET),
        capture_output=True,
        text=True,
    )


def test_adaptive_search_profiles_beyond_partial_and_resumes_without_measuring_again(tmp_path):
    config = tiny_job_config()
    search = config["jobs"]["digits-cnn"]["search"]
    search.update(
        mode="adaptive",
        warmup_steps=1,
        steps=2,
        min_measure_s=0.1,
        max_attempts=1,
        adaptive={"tolerance": 1e-6, "max_profiles": 5},
        confirm=0,  # adaptive search's own profiles alone (tests/integration/test_dag.py confirms a choice)
    )
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake_until_the_model(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = tmp_path / "results" / "digits-cnn"
    plan = json.loads((results / "plan.json").read_text())
    manifest = json.loads((results / "adaptive.json").read_text())
    assert manifest["stopped"] == "reached max_profiles (5)"
    assert manifest["profiled"] == 5 == len(plan["profile"]) + len(manifest["added"]) == len(plan["profile"]) + 1
    step, [added] = manifest["history"][0], manifest["added"]
    assert (added["nodes"], added["global_batch"]) == (step["nodes"], step["batch"])
    # Declared outputs only under results/: the added profile is kept for resuming under work/.
    assert sorted(p.name for p in (results / "profile").iterdir()) == sorted(
        f"N{c['nodes']}_B{c['batch']}.json" for c in plan["profile"]
    )
    extra = tmp_path / "work" / "digits-cnn" / "adaptive" / f"N{step['nodes']}_B{step['batch']}.json"
    assert json.loads(extra.read_text()) == added
    perfmodel = json.loads((results / "perfmodel.json").read_text())
    assert perfmodel["search"]["history"] == manifest["history"] and len(perfmodel["profiled"]) == 5

    # Killed after its profiles were written: the rerun reads them back instead of submitting new jobs.
    before = extra.stat().st_mtime_ns
    (results / "adaptive.json").unlink()
    (results / "perfmodel.json").unlink()
    rerun = snakemake_until_the_model(tmp_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert extra.stat().st_mtime_ns == before
    assert "submitted" not in (tmp_path / "logs" / "digits-cnn" / "adapt.log").read_text()
