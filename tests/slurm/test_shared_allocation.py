"""The measuring phase's shared allocation on the local cluster, under the faults the per-stage jobs are tested
with: its time limit and a requeue interrupt a step (taken again), one of two nodes runs out of memory (the step
ends at once). A killed driver is in test_dag_slurm.py, a killed rank and a step over its memory in
test_failures.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import unique_job_config, wait_for
from tests.integration.test_oom import out_of_memory_beside_a_rank_that_never_notices
from tests.slurm.conftest import SCRIPTS, STATE, measuring_spec, sacct_jobs, sacct_steps, step_end_time
from tests.slurm.workers import hang_the_first_time
from tula_hpc.cluster import allocation, launch, slurm_states
from tula_hpc.cluster.launchers.shared_allocation import SharedAllocationLauncher
from tula_hpc.config import job_settings, load_config
from tula_hpc.core.atomic_files import read_json

pytestmark = pytest.mark.slow


def _holders(work, *known: str) -> list[dict]:
    return sacct_jobs(f"{work.name}-allocation", known)


def test_a_step_its_allocations_time_limit_ends_is_taken_again_in_a_new_one(slurm_cluster, tmp_path, request):
    """A 1-minute allocation: the first measurement is written in it; the second outlasts it (Slurm ends it at its
    limit, within a 30 s tick) and is taken again in a new allocation, the first not again."""
    spec, work = measuring_spec(request, tmp_path, "shared", nodes=1, time_min=1, mem_gb=0.5)
    first = launch.run(hang_the_first_time, {"marker": str(tmp_path / "a"), "seconds": 0}, spec, work / "a", "a")
    second = launch.run(hang_the_first_time, {"marker": str(tmp_path / "b"), "seconds": 600}, spec, work / "b", "b")
    assert (tmp_path / "b").read_text() == str(first), "the second measurement started in the first allocation"
    assert second != first
    holders = _holders(work, str(first), str(second))
    assert [h["job_id"] for h in holders] == [str(first), str(second)]
    assert holders[0]["state"] == "TIMEOUT"
    assert read_json(work / "a" / "job.json")["job_id"] == str(first)  # written once, not measured again


def test_a_step_its_allocation_is_requeued_under_runs_again_in_it(slurm_cluster, tmp_path, request):
    """`scontrol requeue` of the allocation (as a preemption in requeue mode does) ends its step; the measurement
    runs again once the same allocation runs again, and no second one is asked for."""
    spec, work = measuring_spec(request, tmp_path, "shared", nodes=1, time_min=10, mem_gb=0.5)
    outcome: dict = {}

    def measure():
        outcome["job"] = launch.run(
            hang_the_first_time, {"marker": str(tmp_path / "m"), "seconds": 600}, spec, work / "m", "m"
        )

    stage = threading.Thread(target=measure)
    stage.start()
    holder = wait_for(lambda: (tmp_path / "m").exists() and (tmp_path / "m").read_text(), 120, "the step to run")
    subprocess.run(["scontrol", "requeue", holder], check=True)
    stage.join(timeout=300)
    assert not stage.is_alive(), "the measurement still waits after the requeue"
    assert outcome["job"] == int(holder)
    assert [h["job_id"] for h in _holders(work, holder)] == [holder]


def test_a_driver_killed_as_its_step_starts_finds_the_step_on_its_rerun(slurm_cluster, tmp_path, request, monkeypatch):
    """A driver that dies after its srun started the step and before it recorded the srun: the record, written
    before the srun starts, names the allocation; the rerun finds the step by its name there and waits for it. The
    srun, in a session of its own, is not killed with the driver (Slurm would cancel the step)."""
    spec, work = measuring_spec(request, tmp_path, "shared", nodes=1, time_min=10, mem_gb=0.5)
    started = []
    submit = SharedAllocationLauncher.submit

    def killed_as_it_starts(self, *args):
        started.append(submit(self, *args))
        raise KeyboardInterrupt  # the driver dies here, before it hears of the srun

    monkeypatch.setattr(SharedAllocationLauncher, "submit", killed_as_it_starts)
    with pytest.raises(KeyboardInterrupt):
        launch.run(hang_the_first_time, {"marker": str(tmp_path / "m"), "seconds": 10}, spec, work / "m", "m")
    monkeypatch.undo()
    wait_for(lambda: (tmp_path / "m").exists(), 120, "the step to run")
    holder = launch.run(hang_the_first_time, {"marker": str(tmp_path / "m"), "seconds": 10}, spec, work / "m", "m")
    assert [step["name"] for step in sacct_steps(str(holder))] == ["m"]  # waited for, not measured again
    assert started[0].process.wait() == 0


def test_out_of_memory_on_one_of_two_nodes_ends_the_step_at_once(slurm_cluster, tmp_path):
    """The OOM agreement inside the shared allocation: rank 1's exit and the step's --kill-on-bad-exit end rank 0,
    which never notices on its own, and the allocation runs on for the next measurement."""
    name, config_path = unique_job_config(tmp_path, epochs=3, lr_milestones=[])
    job = job_settings(load_config([config_path], {"launcher": "slurm"}), name)
    work = tmp_path / "work" / name
    spec = launch.LaunchSpec.for_job(job, nodes=2, measuring_in=work)
    assert spec.allocation is not None, "resources.allocation shared is the default"
    try:
        record, noticed = out_of_memory_beside_a_rank_that_never_notices(job, spec, tmp_path / "agreement")
        holder = read_json(work / "allocation" / "allocation.json")["job_id"]
        step_end = step_end_time(holder)
        assert step_end - record["recorded_at"] < 15  # rank 0 alone would sleep NEVER_NOTICES_S
        assert slurm_states.slurm_state(holder) == "RUNNING"
    finally:
        allocation.release_allocation(work)


def test_the_allocation_is_given_back_even_while_slurmctld_restarts(slurm_cluster, tmp_path, request):
    """bench/chaos.py found it: the last profile's scancel of the allocation failed while slurmctld was away, the
    record was dropped all the same, and the allocation held both nodes while the train job waited behind it. Now
    the cancel is tried again until slurmctld answers."""
    spec, work = measuring_spec(request, tmp_path, "shared", nodes=1, time_min=10, mem_gb=0.5)
    launch.run(hang_the_first_time, {"marker": str(tmp_path / "m"), "seconds": 0}, spec, work / "m", "m")
    holder = read_json(work / "allocation" / "allocation.json")["job_id"]
    controller = int((STATE / "pids" / "slurmctld.pid").read_text())
    os.kill(controller, signal.SIGTERM)
    wait_for(lambda: not _alive(controller), 60, "slurmctld to stop")
    released = threading.Thread(target=allocation.release_allocation, args=(work,))
    released.start()
    time.sleep(8)  # scancel fails meanwhile
    assert released.is_alive(), "the allocation was given up on while slurmctld was away"
    subprocess.run(["bash", str(SCRIPTS / "up.sh")], check=True, capture_output=True)
    released.join(timeout=120)
    assert not released.is_alive()
    states = []
    wait_for(
        lambda: states.append(slurm_states.slurm_state(holder)) or states[-1] not in ("RUNNING", "PENDING"), 60, ""
    )
    assert states[-1] in ("CANCELLED", "COMPLETING"), states


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
