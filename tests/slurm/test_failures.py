"""Failures through real Slurm end the stage with the state, the job id and the log to read."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.slurm.conftest import measuring_spec
from tests.slurm.workers import all_reduce_for, hang_the_first_time, hold_memory
from tula_hpc.cluster import launch
from tula_hpc.core.atomic_files import read_json


def _rank_pid(job_id: str, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
            cmdline = (proc / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_PROCID") == str(rank)
            and "submitit.core._submit" in cmdline
        ):
            return int(proc.name)
    return None


ALLOCATIONS = ["per_stage", "shared"]  # a job of its own; a step of the measuring phase's shared allocation


@pytest.mark.slow
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_a_killed_rank_ends_the_job_within_seconds_and_a_rerun_completes(slurm_cluster, tmp_path, request, allocation):
    spec, work = measuring_spec(request, tmp_path, allocation, nodes=2, time_min=10, mem_gb=1)
    outcome: dict = {}

    def run_stage():
        try:
            launch.run(all_reduce_for, {"seconds": 240}, spec, work, name="rank-kill")
        except launch.JobFailed as err:
            outcome["error"], outcome["ended"] = str(err), time.time()

    stage = threading.Thread(target=run_stage)
    stage.start()
    job_id = wait_for(lambda: (work / "job.json").exists() and read_json(work / "job.json")["job_id"], 60, "submission")
    pid = wait_for(lambda: _rank_pid(job_id, 1), 60, "rank 1 to start")
    time.sleep(3)  # let the group form and the ranks enter their collectives
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    stage.join(timeout=120)
    assert not stage.is_alive(), "the stage still waits: the surviving rank was left hanging"
    assert outcome["ended"] - killed < 45
    assert f"job {job_id} ended" in outcome["error"]
    assert any(state in outcome["error"] for state in ("FAILED", "CANCELLED")), outcome["error"]
    assert "read " in outcome["error"] and "_log.err" in outcome["error"]
    assert launch.run(all_reduce_for, {"seconds": 1}, spec, work, name="rank-kill") == 2


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_a_job_over_its_memory_limit_is_reported_out_of_memory(slurm_cluster, tmp_path, request, allocation):
    spec, work = measuring_spec(request, tmp_path, allocation, nodes=1, time_min=5, mem_gb=0.25)
    with pytest.raises(launch.JobFailed, match=r"job \d+ ended OUT_OF_MEMORY; read .*_log\.err"):
        launch.run(hold_memory, {"megabytes": 1024}, spec, work, name="over-mem")


@pytest.mark.slow
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_work_of_a_job_whose_node_is_set_down_runs_again(slurm_cluster, tmp_path, request, allocation):
    """bench/chaos.py found it: Slurm requeues a job whose node went DOWN (JobRequeue) under the same id, and
    submitit's watcher took its NODE_FAIL for its end, so the stage failed ("ended PENDING") while its job was
    queued to run again; and a requeued job that started while its first run's step still ended on the node was
    requeued held, for good. Now the work runs again: in the same job (the same allocation) once it runs again,
    or in a new one where Slurm holds it."""
    spec, work = measuring_spec(request, tmp_path, allocation, nodes=1, time_min=10, mem_gb=0.5)
    marker, outcome = tmp_path / "marker", {}

    def run_stage():
        try:
            outcome["job"] = launch.run(hang_the_first_time, {"marker": str(marker), "seconds": 600}, spec, work, "n")
        except launch.JobFailed as err:
            outcome["error"] = str(err)

    stage = threading.Thread(target=run_stage, daemon=True)
    stage.start()
    job_id = wait_for(lambda: marker.exists() and marker.read_text(), 120, "the job to run")
    nodes = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    node = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True).stdout.split()[0]
    update = ["scontrol", "update", f"nodename={node}"]
    # Away for a while, as bench/chaos.py's node_down (DOWN returns at once under ReturnToService=2: drained too).
    # Back at once, Slurm would find the first run's job still on the node, "Duplicate jobid", and drain it.
    subprocess.run([*update, "state=down", "reason=test"], check=True)
    request.addfinalizer(lambda: subprocess.run([*update, "state=resume"], capture_output=True))
    subprocess.run([*update, "state=drain", "reason=test"], check=True)
    time.sleep(20)  # past KillWait: the first run's processes are gone
    subprocess.run([*update, "state=resume"], check=True)
    stage.join(timeout=240)
    assert not stage.is_alive(), "the stage still waits after its job was requeued"
    assert "job" in outcome, outcome  # the same job (allocation) running again, or a new one for a held one
