"""Results made by the code before issue 57's settings existed stay reusable: the DAG run with that code, then
`snakemake -n` with this checkout on the same folder finds nothing to do, and the checkpoint it left matches what
this checkout's trainer would resume (core/dependencies.LATER_SETTINGS)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.conftest import REPO, default_job, snakemake_command, tiny_job_config
from tula_hpc.core.dependencies import stage_settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BEFORE = "4286ac3"  # main before issue 57: no task, seq_len, adamw, run length or validation settings
SHORTER = {"train": {"epochs": 1, "lr_milestones": []}, "search": {"nodes": {"min": 1, "max": 1}, "confirm": 0}}


@pytest.fixture
def earlier_checkout(tmp_path):
    """A worktree of the code before the issue, removed afterwards."""
    folder = tmp_path / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), BEFORE], check=True)
    yield folder
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=True)


def test_results_of_the_code_before_have_nothing_to_do_under_this_checkout(earlier_checkout, tmp_path):
    config = tiny_job_config()
    job_config = config["jobs"]["digits-cnn"]
    job_config["train"].update(SHORTER["train"])  # as few stage jobs as a whole DAG takes: one node, one epoch
    job_config["search"].update(SHORTER["search"])
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    before = [
        *(sys.executable, "-m", "snakemake", "-s", str(earlier_checkout / "Snakefile"), "-d", str(workdir)),
        *("--profile", str(earlier_checkout / "profiles" / "local"), "--configfile", str(workdir / "jobs.yaml")),
    ]
    env = {**os.environ, "PYTHONPATH": str(earlier_checkout)}
    made = subprocess.run(before, capture_output=True, text=True, env=env, cwd=earlier_checkout)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-5000:]
    assert (workdir / "results" / "digits-cnn" / "report.md").exists()
    now = subprocess.run(
        snakemake_command(workdir, "local", workdir / "jobs.yaml", "-n"), capture_output=True, text=True, cwd=REPO
    )
    assert now.returncode == 0, now.stdout[-3000:] + now.stderr[-3000:]
    assert "Nothing to be done" in now.stdout + now.stderr, now.stdout[-3000:]
    checkpoint = torch.load(workdir / "work" / "digits-cnn" / "train" / "checkpoint.pt", weights_only=False)
    job = default_job(**SHORTER)
    saved = {k: v for k, v in checkpoint["run"].items() if k not in ("selected_batch", "format")}
    assert saved == stage_settings(job.as_dict(), "train")
