"""Training as a Checkpointable Slurm job: time limits, requeues and scontrol requeue resume from step checkpoints;
running out of memory on one node ends the step and relaunches."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch
import yaml

from tests.conftest import paced_job, train_stage, unique_job_config, wait_for
from tests.integration.test_oom import TIGHT_GB, out_of_memory_beside_a_rank_that_never_notices
from tests.slurm.conftest import sacct_jobs, step_end_time
from tula_hpc.cluster import launch
from tula_hpc.cluster.slurm_states import slurm_state
from tula_hpc.config import job_settings, load_config
from tula_hpc.core.atomic_files import read_json


@pytest.mark.slow
def test_time_limit_requeues_resume_from_checkpoints_and_match_an_uninterrupted_run(slurm_cluster, tmp_path):
    """1-minute limits: Slurm's warning makes submitit requeue the job, which resumes from its last checkpoint.

    The warning comes at most 45 s into an allocation (Slurm acts on a 30 s tick, so often sooner). Epochs are
    paced (4 s asleep each): an allocation trains at most about 11 on any machine, so 24 need at least 3
    allocations; each saves the step the warning reached (resumed mid-epoch) before it requeues.
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
    restarts = summary["restarts_at_steps"]
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
def test_scontrol_requeue_mid_epoch_saves_that_step_and_ends_with_the_same_weights(slurm_cluster, tmp_path):
    """`scontrol requeue` sends SIGTERM (SIGKILL KillWait seconds later): training saves the step it is in and
    the requeued job resumes there, ending where an uninterrupted run ends."""
    name, config_path = paced_job(tmp_path / "requeued", epochs=6, time_min=30)
    stage = train_stage(tmp_path, name, config_path, "slurm", "run", background=True)
    checkpoint = tmp_path / "run" / "work" / "train" / "checkpoint.pt"
    wait_for(
        lambda: checkpoint.exists() and torch.load(checkpoint, weights_only=False)["state"]["epoch"] >= 2,
        300,
        "two epochs",
        interval=0.5,
    )
    time.sleep(2.0)  # about 8 of epoch 3's 20 paced steps
    job_id = json.loads((tmp_path / "run" / "work" / "train" / "job.json").read_text())["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    out, _ = stage.communicate(timeout=900)
    assert stage.returncode == 0, out[-3000:]
    ref_name, ref_config_path = paced_job(tmp_path / "reference", epochs=6, model="tiny_cnn", time_min=30)
    reference = train_stage(tmp_path, ref_name, ref_config_path, "local", "reference")
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    summary = json.loads((tmp_path / "run" / "out" / "summary.json").read_text())
    [restart] = summary["restarts_at_steps"]
    per_epoch = summary["steps_per_epoch"]
    assert 2 * per_epoch < restart < 3 * per_epoch, f"resumed at step {restart}, not in epoch 3"
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 7))
    wait_for(lambda: slurm_state(job_id) == "COMPLETED", 60, "the requeued job to complete in Slurm")
    resumed = torch.load(tmp_path / "run" / "out" / "model.pt", weights_only=False)["model"]
    uninterrupted = torch.load(tmp_path / "reference" / "out" / "model.pt", weights_only=False)["model"]
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.slow
def test_out_of_memory_on_one_of_two_nodes_ends_the_step_at_once_and_the_stage_keeps_the_batch(slurm_cluster, tmp_path):
    """The OOM agreement on 2 nodes: rank 0 never notices on its own (as under NCCL); rank 1's exit and srun's
    --kill-on-bad-exit end the step. Then the whole stage: out of memory relaunches at the same global batch."""
    name, config_path = unique_job_config(tmp_path, epochs=3, lr_milestones=[])
    job = job_settings(load_config([config_path], {"launcher": "slurm"}), name)
    spec = launch.LaunchSpec.for_job(job, nodes=2)
    record, noticed = out_of_memory_beside_a_rank_that_never_notices(job, spec, tmp_path / "agreement")
    job_id = read_json(tmp_path / "agreement" / "stage" / "job.json")["job_id"]
    step_end = step_end_time(job_id)
    print(
        f"step ended {step_end - record['recorded_at']:.1f} s after the record; stage knew after "
        f"{noticed - record['recorded_at']:.1f} s"
    )
    assert step_end - record["recorded_at"] < 15  # rank 0 alone would sleep NEVER_NOTICES_S

    config = yaml.safe_load(config_path.read_text())
    config["jobs"][name]["resources"]["device_memory_gb"] = TIGHT_GB
    config_path.write_text(yaml.safe_dump(config))
    stage = train_stage(tmp_path, name, config_path, "slurm", "stage", nodes=2, batch=512)
    assert stage.returncode == 0, stage.stdout[-3000:] + stage.stderr[-3000:]
    attempts = json.loads((tmp_path / "stage" / "out" / "summary.json").read_text())["attempts"]
    assert attempts[0]["outcome"] == "out_of_memory" and attempts[-1]["outcome"] == "completed"
    assert {a["global_batch"] for a in attempts} == {512}
    assert [a["accumulation"] for a in attempts] == [2**i for i in range(len(attempts))]
