"""The whole DAG through profiles/slurm on the local cluster: real sbatch, 2-node profiling, re-attach."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from tests.conftest import snakemake_command, unique_job_config, wait_for
from tests.slurm.conftest import sacct_jobs, sacct_steps
from tula_hpc.cluster.slurm_states import slurm_state

pytestmark = pytest.mark.slow  # the module's DAG run takes about 90 s


def snakemake(workdir, config_path, background=False):
    cmd = snakemake_command(workdir, "slurm", config_path)
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-dag")
    name, config_path = unique_job_config(workdir)
    proc = snakemake(workdir, config_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir, name, config_path


def test_the_measuring_phase_waits_once_and_profiles_in_two_node_steps_and_training_uses_the_chosen_nodes(
    slurm_run,
):
    """resources.allocation shared (the default): one allocation, asked for once and given back by fit_model,
    runs the memory probe and every profile as its job steps; no measurement is a job of its own."""
    workdir, name, _ = slurm_run
    results = workdir / "results" / name
    plan = json.loads((results / "plan.json").read_text())
    two_node = [c for c in plan["profile"] if c["nodes"] == 2]
    assert two_node, "the plan must profile 2-node configurations"
    [holder] = sacct_jobs(f"{name}-allocation")
    assert holder["nodes"] == "2" and holder["state"].startswith("CANCELLED")  # given back
    steps = {step["name"]: step for step in sacct_steps(holder["job_id"])}
    assert steps[f"{name}-probe-memory"]["state"] == "COMPLETED"
    for c in two_node:
        step = steps[f"{name}-profile-N2-B{c['batch']}"]
        assert (step["nodes"], step["state"]) == ("2", "COMPLETED")
        assert not sacct_jobs(f"{name}-profile-N2-B{c['batch']}")
        assert json.loads((results / "profile" / f"N2_B{c['batch']}.json").read_text())["world_size"] == 2
    assert not (workdir / "work" / name / "allocation" / "allocation.json").exists()
    chosen = json.loads((results / "selection.json").read_text())["chosen"]
    [train] = sacct_jobs(f"{name}-train")
    assert (train["nodes"], train["state"]) == (str(chosen["nodes"]), "COMPLETED")
    assert json.loads((results / "eval.json").read_text())["test_accuracy"] >= 0.9


def test_killed_driver_reattaches_to_the_running_training_job(slurm_run):
    """SIGKILL Snakemake and the stage it ran while training runs in Slurm; the rerun waits for that job."""
    workdir, name, config_path = slurm_run
    config = yaml.safe_load(config_path.read_text())
    config["jobs"][name]["train"]["epochs"] = 60  # reruns train (and what follows), long enough to interrupt
    config_path.write_text(yaml.safe_dump(config))
    record = workdir / "work" / name / "train" / "job.json"
    first_job = json.loads(record.read_text())["job_id"]
    driver = snakemake(workdir, config_path, background=True)
    job_id = wait_for(
        lambda: (
            record.exists()
            and json.loads(record.read_text())["job_id"] != first_job
            and json.loads(record.read_text())["job_id"]
        ),
        180,
        "the new training submission",
    )
    wait_for(lambda: slurm_state(job_id) == "RUNNING", 60, "training to run")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert slurm_state(job_id) == "RUNNING", "the Slurm job must outlive the driver"
    rerun = snakemake(workdir, config_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    trains = sacct_jobs(f"{name}-train", (first_job, job_id))
    assert [j["job_id"] for j in trains] == [first_job, job_id], "a duplicate was submitted"
    assert f"re-attached to slurm job {job_id}" in (workdir / "logs" / name / "train.log").read_text()
    summary = json.loads((workdir / "results" / name / "train" / "summary.json").read_text())
    assert summary["epochs"] == 60 and summary["history"][-1]["epoch"] == 60


def test_a_driver_killed_while_profiling_is_rerun_in_the_same_allocation(slurm_cluster, tmp_path):
    """SIGKILL Snakemake (its stages with it) while a profile runs as a step: the allocation, a job of its own,
    outlives the driver, and so does the step's srun, in a session of its own (Slurm cancels a launched step whose
    srun dies: CI once saw a profile measured twice); the rerun waits for the step and takes the other
    measurements in the same allocation (no second wait in the queue)."""
    name, config_path = unique_job_config(tmp_path)
    driver = snakemake(tmp_path, config_path, background=True)
    profiles = tmp_path / "work" / name / "profile"
    wait_for(lambda: any(profiles.glob("*/submit-*/*_0_log.out")), 300, "a profile step to run")
    time.sleep(2)  # well past the step's launch
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    [holder] = sacct_jobs(f"{name}-allocation")
    assert slurm_state(holder["job_id"]) == "RUNNING", "the allocation must outlive the driver"
    rerun = snakemake(tmp_path, config_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert [h["job_id"] for h in sacct_jobs(f"{name}-allocation")] == [holder["job_id"]]
    # The step the kill interrupted ran on with its srun: the rerun waited for it, no profile ran twice.
    profiled = [s for s in sacct_steps(holder["job_id"]) if "-profile-" in s["name"]]
    assert len({s["name"] for s in profiled}) == len(profiled), profiled
    assert all(s["state"] == "COMPLETED" for s in profiled), profiled
    logs = (tmp_path / "logs" / name / "profile").glob("*.log")
    assert any("re-attached to slurm_shared job" in log.read_text() for log in logs)
    assert (tmp_path / "results" / name / "eval.json").exists()
