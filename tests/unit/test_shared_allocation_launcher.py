"""launchers/shared_allocation: a measurement as a job step of the shared allocation, its srun command, and a step
found again by its srun or its name in the allocation.

No cluster: fake `sbatch`, `squeue`, `sacct` and `srun` on PATH stand in for Slurm (as in submitit's own tests).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
from pathlib import Path

import psutil
import pytest
from submitit.core.utils import cloudpickle_dump

from tests.conftest import fake_commands as _fake_commands
from tests.conftest import wait_for
from tests.unit.test_slurm_states import SACCT_STEPS
from tula_hpc.cluster import launch, slurm_states
from tula_hpc.cluster.launch_spec import Allocation, LaunchSpec
from tula_hpc.cluster.launchers import shared_allocation
from tula_hpc.cluster.launchers.shared_allocation import SharedAllocationLauncher, StepJob, step_command
from tula_hpc.core.job import SlurmSettings

PARTITION = "PartitionName=debug Default=YES MaxNodes=UNLIMITED MaxTime=04:00:00 TotalNodes=2 TRES=cpu=4,node=2"


def shared_spec(tmp_path: Path, nodes: int = 1) -> LaunchSpec:
    """A measurement of `nodes` nodes in a 2-node shared allocation recorded under tmp_path/work/allocation."""
    shared = Allocation(str(tmp_path / "work" / "allocation"), nodes=2, gpus_per_node=0, time_min=60)
    slurm = SlurmSettings(partition="debug")
    return LaunchSpec("slurm", nodes=nodes, mem_gb=1, time_min=20, slurm=slurm, allocation=shared)


def answer(value: int) -> int:
    return value + 1


def test_a_measurement_step_asks_slurm_for_what_the_docs_say():
    spec = shared_spec(Path("/w"), nodes=2)
    step = step_command(spec, "77", Path("/w/profile"), "job-profile")
    assert step[:4] == ["srun", "--jobid=77", "--job-name=job-profile", "--nodes=2"]
    assert {"--exact", "--mem=1024M", "--time=20", "--kill-on-bad-exit=1", "--ntasks-per-node=1"} <= set(step)
    assert "--overlap" not in step and step[-4:] == ["-u", "-m", "submitit.core._submit", "/w/profile"]


def test_a_measurement_step_asks_for_the_sites_gpus_memory_and_setup_as_the_jobs_do():
    slurm = SlurmSettings(gpu_type="a100", gpu_binding="task", mem_per_gpu_gb=12, setup=("module load cuda",))
    spec = dataclasses.replace(shared_spec(Path("/w")), gpus_per_node=2, cpus_per_task=4, slurm=slurm)
    step = step_command(spec, "77", Path("/w/profile"), "job-profile")
    assert {"--gpus-per-task=a100:1", "--mem-per-gpu=12288M", "--cpus-per-task=4", "--ntasks-per-node=2"} <= set(step)
    assert not any(word.startswith(("--mem=", "--gpus-per-node")) for word in step)
    assert step[step.index("-c") + 1].startswith("module load cuda\n") and step[-1] == "/w/profile"


@pytest.mark.spawns
def test_a_step_runs_submitits_runner_in_the_allocation_and_its_result_is_read_at_once(tmp_path, monkeypatch):
    """A fake srun runs the step's command here as Slurm would start its 2 ranks (the allocation's job id, the
    step's node list); run() returns rank 0's result although the allocation runs on."""
    srun = (
        'while [ "${1#--}" != "$1" ]; do shift; done\n'  # srun's options, then the command
        "export SLURM_JOB_ID=77 SLURM_NTASKS=2 SLURM_NODEID=0 SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST='n[1-2]'\n"
        "export SLURM_STEP_NUM_NODES=1 SLURM_STEP_NODELIST=n2\n"
        'SLURM_PROCID=1 SLURM_LOCALID=1 "$@" & SLURM_PROCID=0 SLURM_LOCALID=0 "$@"; wait'
    )
    _fake_commands(
        tmp_path, monkeypatch, sbatch="echo 77", squeue="echo RUNNING", srun=srun, scontrol=f"echo '{PARTITION}'"
    )
    spec = dataclasses.replace(shared_spec(tmp_path), gpus_per_node=2)  # 1 node, 2 ranks (no GPU is asked here)
    assert launch.run(answer, {"value": 41}, spec, tmp_path / "work" / "profile", name="profile") == 42
    record = (tmp_path / "work" / "profile" / "job.json").read_text()
    assert '"launcher": "slurm_shared"' in record and '"job_id": "77"' in record


@pytest.mark.parametrize(
    ("allocation", "ended", "expected"),
    [
        ("RUNNING", "RUNNING", ("OUT_OF_MEMORY", False)),
        ("PENDING", "PENDING", ("REQUEUED", True)),
        ("", "TIMEOUT", ("TIMEOUT", True)),
        ("", "FAILED", ("FAILED", True)),  # the holder's batch node lost: the holder does no work that could fail
        ("", "CANCELLED", ("CANCELLED", False)),
    ],
)
@pytest.mark.spawns
def test_a_failed_step_is_told_from_the_allocation_ending_or_going_back_to_the_queue(
    tmp_path, monkeypatch, allocation, ended, expected
):
    """The step's own end while the allocation runs (the stage fails); REQUEUED while it is queued again and the
    allocation's end once Slurm has let it go: the measurement goes again unless someone cancelled the allocation."""
    sacct = f'case "$*" in *JobName*) printf "{SACCT_STEPS}";; *) echo {ended};; esac'
    _fake_commands(tmp_path, monkeypatch, squeue=f"echo {allocation}", sacct=sacct)
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.05)
    step = StepJob(tmp_path, "77", step_name="job-profile-N1-B32")
    assert SharedAllocationLauncher().end_state(step) == expected


@pytest.mark.spawns
def test_a_step_whose_srun_is_gone_is_waited_for_in_slurm_not_measured_again(tmp_path, monkeypatch):
    """The record's srun is gone (its pid now another process's); Slurm still lists the step (twice), then not; its
    result is read, nothing is submitted. A step that finished while no driver ran is read the same way."""
    count = tmp_path / "count"
    log = _fake_commands(
        tmp_path, monkeypatch, squeue=f'echo x >>{count}; [ "$(wc -l <{count})" -le 2 ] && echo job-profile; exit 0'
    )
    monkeypatch.setattr(shared_allocation, "ALLOCATION_POLL_S", 0.01)
    stage_dir, folder = tmp_path / "profile", tmp_path / "profile" / "submit-x"
    folder.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "30"])
    srun = [other.pid, psutil.Process(other.pid).create_time() - 60]  # the pid, reused
    record = {"launcher": "slurm_shared", "name": "job-profile", "srun": srun, "job_id": "77"}
    (stage_dir / "job.json").write_text(json.dumps({**record, "folder": str(folder), "tasks": 1}))
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\nexit 1\n")  # a submission would fail the test
    cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")
    assert launch.run(answer, {"value": 0}, LaunchSpec("slurm"), stage_dir, name="job-profile") == 5
    assert log.read_text().count("squeue -h -s -j 77") == 3  # reattach, then wait until it is gone
    assert launch.run(answer, {"value": 0}, LaunchSpec("slurm"), stage_dir, name="job-profile") == 5
    other.kill()


@pytest.mark.spawns
def test_a_steps_srun_that_no_record_names_is_found_by_its_folder(tmp_path):
    """A driver killed before it recorded the srun, which may still wait for the step's resources."""
    folder = tmp_path / "profile" / "submit-20261125-0731-cc22dd"
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nsleep 30\n")
    srun.chmod(0o755)
    waiting = subprocess.Popen([str(srun), "--jobid=77", "-m", "submitit.core._submit", str(folder)])
    try:
        wait_for(lambda: psutil.Process(waiting.pid).name() == "srun", 10, "the fake srun to start")
        record = {"launcher": "slurm_shared", "name": "job-profile", "job_id": "77", "folder": str(folder)}
        job = SharedAllocationLauncher().reattach({**record, "tasks": 1})
        assert job.srun == (waiting.pid, psutil.Process(waiting.pid).create_time()) and job.srun_alive()
    finally:
        waiting.kill()


@pytest.mark.spawns
def test_a_step_whose_results_are_written_is_done_after_a_grace_though_slurm_still_lists_it(tmp_path, monkeypatch):
    """A step's end waits on slurmctld (restarted: srun retries for a minute or more); its written results are read
    STEP_END_GRACE_S after they appeared."""
    _fake_commands(tmp_path, monkeypatch, squeue="echo job-profile")  # listed for ever
    monkeypatch.setattr(shared_allocation, "ALLOCATION_POLL_S", 0.01)
    monkeypatch.setattr(shared_allocation, "STEP_END_GRACE_S", 0.05)
    step = StepJob(tmp_path, "77", step_name="job-profile")
    cloudpickle_dump(("success", 5), tmp_path / "77_0_result.pkl")
    SharedAllocationLauncher().wait(step, LaunchSpec("slurm"), "profile")
    assert SharedAllocationLauncher().results(step) == [5]


@pytest.mark.spawns
def test_a_step_whose_allocation_runs_again_since_it_began_ended_under_it(tmp_path, monkeypatch):
    """A lost node requeues the allocation; the step's srun ends only once the node's step is cleaned up, and the
    allocation may run again by then: RUNNING, yet the step ended under it and the measurement goes again."""
    _fake_commands(tmp_path, monkeypatch, squeue='case "$*" in *%S*) echo 2026-11-28T07:53:42;; *) echo RUNNING;; esac')
    began_before = datetime.datetime(2026, 11, 28, 7, 53, 10).timestamp()
    step = StepJob(tmp_path, "77", srun=(1, began_before), step_name="job-profile-N1-B32")
    assert SharedAllocationLauncher().end_state(step) == ("REQUEUED", True)


@pytest.mark.spawns
def test_a_step_whose_allocation_is_being_preempted_ended_under_it(tmp_path, monkeypatch):
    """PreemptMode=CANCEL: the allocation runs on for its GraceTime, its steps signalled at once; a step that ended
    then ended under the allocation, which ends PREEMPTED: the measurement goes again (in a new allocation)."""
    _fake_commands(
        tmp_path,
        monkeypatch,
        squeue="echo RUNNING",
        scontrol="echo JobId=77 PreemptTime=2026-11-28T08:55:40 SuspendTime=None",
    )
    step = StepJob(tmp_path, "77", step_name="job-profile-N1-B32")
    assert SharedAllocationLauncher().end_state(step) == ("PREEMPTED", True)
