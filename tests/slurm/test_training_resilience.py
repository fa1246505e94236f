"""Training as a Checkpointable Slurm job: time limits, requeues and scontrol requeue resume from checkpoints."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.conftest import paced_job, train_stage, wait_for
from tests.slurm.conftest import sacct_jobs
from tula_hpc.launch import slurm_state


@pytest.mark.slow
def test_time_limit_requeues_resume_from_checkpoints_and_match_an_uninterrupted_run(slurm_cluster, tmp_path):
    """1-minute limits: Slurm's warning makes submitit requeue the job, which resumes from its last checkpoint.

    The warning comes at most 45 s into an allocation (Slurm acts on a 30 s tick, so often sooner). Epochs are
    paced (4 s asleep each): an allocation finishes at most about 11 on any machine, so 24 need at least 3
    allocations; here each finished about 2 (6 min in all). An allocation that finishes none records no restart;
    max_requeues leaves room for those at half this machine's speed.
    """
    epochs = 24
    name, config_path = paced_job(tmp_path / "requeued", epochs, time_min=1, max_requeues=30)
    on_slurm = train_stage(tmp_path, name, config_path, "slurm", "slurm")
    assert on_slurm.returncode == 0, on_slurm.stdout[-3000:] + on_slurm.stderr[-3000:]
    # The uninterrupted run comes after, not beside it (two cores), and without the pacing (no effect on weights).
    ref_name, ref_config_path = paced_job(tmp_path / "reference", epochs, model="tiny_cnn", time_min=30)
    reference = train_stage(tmp_path, ref_name, ref_config_path, "local", "local")
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    summary = json.loads((tmp_path / "slurm" / "out" / "summary.json").read_text())
    restarts = summary["restarts_at_epochs"]
    assert len(restarts) >= 2, f"expected at least 2 requeues at the 1-minute limit, saw restarts at {restarts}"
    assert 0 < restarts[0] and restarts == sorted(set(restarts)), f"each restart resumes later: {restarts}"
    assert [h["epoch"] for h in summary["history"]] == list(range(1, epochs + 1))
    rank0_log = next((tmp_path / "slurm" / "work" / "train").glob("submit-*/*_0_log.err")).read_text()
    assert rank0_log.count("this job is timed-out") >= len(restarts), "every restart followed a time limit"
    # One allocation, requeued in place: no duplicate submissions. (Its final sacct state is not asserted: after
    # several requeues Slurm 22.05 sometimes records FAILED for the last run although it exited 0.)
    assert len(sacct_jobs(f"{name}-train")) == 1
    # Resuming at epoch boundaries with the RNG, optimiser and scheduler state restored is exact.
    resumed = torch.load(tmp_path / "slurm" / "out" / "model.pt", weights_only=False)["model"]
    uninterrupted = torch.load(tmp_path / "local" / "out" / "model.pt", weights_only=False)["model"]
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.slow
def test_scontrol_requeue_resumes_from_the_last_checkpoint(slurm_cluster, tmp_path):
    name, config_path = paced_job(tmp_path, epochs=12, time_min=30)
    stage = train_stage(tmp_path, name, config_path, "slurm", "run", background=True)
    checkpoint = tmp_path / "run" / "work" / "train" / "checkpoint.pt"
    wait_for(
        lambda: checkpoint.exists() and torch.load(checkpoint, weights_only=False)["epoch"] >= 3,
        300,
        "three epochs",
        interval=1,
    )
    job_id = json.loads((tmp_path / "run" / "work" / "train" / "job.json").read_text())["job_id"]
    requeued_after = torch.load(checkpoint, weights_only=False)["epoch"]
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    out, _ = stage.communicate(timeout=900)
    assert stage.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "run" / "out" / "summary.json").read_text())
    assert summary["restarts_at_epochs"][0] >= requeued_after
    assert summary["history"][-1]["epoch"] == 12
    wait_for(lambda: slurm_state(job_id) == "COMPLETED", 60, "the requeued job to complete in Slurm")
