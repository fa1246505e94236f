"""launchers/slurm: the sbatch script submitit writes, a job found again by its id or its name, a job Slurm requeued,
held or pending on a reason no wait clears, one that ended under the work, and results read on a shared file system.

No cluster: fake `sbatch`, `squeue` and `sacct` on PATH stand in for Slurm (as in submitit's own tests).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import cloudpickle_dump

from tests.conftest import fake_commands as _fake_commands
from tula_hpc.cluster import shared_files, slurm_states
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import DistributedTask, JobFailed
from tula_hpc.cluster.launchers.slurm import SlurmLauncher
from tula_hpc.core.job import SlurmSettings

DATA = Path(__file__).parent / "data"


def _worker() -> None:
    """Stands in for a stage's worker: the sbatch script names only submitit's runner, not the function."""


@pytest.mark.spawns
def test_the_sbatch_script_matches_the_recorded_one(tmp_path, monkeypatch):
    """What a 2-node GPU job with account, partition and an extra sbatch argument asks of Slurm."""
    submitted = tmp_path / "submitted.sh"
    log = _fake_commands(tmp_path, monkeypatch, sbatch=f'cp "$1" {submitted}; echo "Submitted batch job 4242"')
    spec = LaunchSpec(
        launcher="slurm",
        nodes=2,
        gpus_per_node=2,
        cpus_per_task=4,
        mem_gb=16,
        time_min=30,
        slurm=SlurmSettings(partition="gpu", account="proj", qos="normal", extra_args=("--exclusive", "--comment=x")),
        max_requeues=5,
    )
    folder = tmp_path / "submit"
    executor = SlurmLauncher().executor(spec, folder, "train")
    job = executor.submit(DistributedTask(_worker, {}, threads=4))
    assert job.job_id == "4242" and job.num_tasks == spec.world_size == 4
    assert log.read_text().startswith("sbatch ")
    script = submitted.read_text().replace(str(folder.resolve()), "{FOLDER}").replace(sys.executable, "{PYTHON}")
    assert script == (DATA / "sbatch_2_nodes_2_gpus.txt").read_text()


@pytest.mark.spawns
def test_gpus_per_node_asks_slurm_for_one_task_per_gpu(tmp_path, monkeypatch):
    """gpus_per_node=2: two tasks on each node, one per GPU (each rank's LOCAL_RANK picks its device)."""
    submitted = tmp_path / "submitted.sh"
    _fake_commands(tmp_path, monkeypatch, sbatch=f'cp "$1" {submitted}; echo "Submitted batch job 4243"')
    spec = LaunchSpec(launcher="slurm", nodes=2, gpus_per_node=2)
    job = SlurmLauncher().executor(spec, tmp_path / "submit", "train").submit(DistributedTask(_worker, {}, threads=1))
    lines = submitted.read_text().splitlines()
    assert "#SBATCH --gpus-per-node=2" in lines and "#SBATCH --ntasks-per-node=2" in lines
    assert "#SBATCH --nodes=2" in lines and job.num_tasks == 4


@pytest.mark.spawns
def test_an_sbatch_job_whose_driver_died_before_recording_its_id_is_found_by_name_and_folder(tmp_path, monkeypatch):
    folder = tmp_path / "train" / "submit-20261125-0731-cc22dd"
    listed = f"537|{folder}/.submission_file_0d9e1f22.sh"
    log = _fake_commands(
        tmp_path, monkeypatch, squeue=f'case "$*" in *--name*) echo "{listed}";; *) echo RUNNING;; esac'
    )
    record = {"launcher": "slurm", "name": "job-train", "job_id": None, "folder": str(folder), "tasks": 1}
    assert SlurmLauncher().reattach(record).job_id == "537"
    assert "squeue -h --name=job-train -o %i|%o" in log.read_text()


@pytest.mark.parametrize(
    ("listed", "reason", "replaced"),
    [("PENDING", "BeginTime", False), ("RUNNING", "None", False), ("PENDING", "launch failed requeued held", True)],
)
@pytest.mark.spawns
def test_a_slurm_job_slurm_requeued_itself_is_waited_for_and_replaced_only_where_it_is_held(
    tmp_path, monkeypatch, listed, reason, replaced
):
    """A lost node ends the job NODE_FAIL and Slurm queues it again under the same id. Queued or running again, it
    is the same job (`again` gives it back, `wait` watches it); held by a failed requeue's launch it is cancelled
    and the work goes in a new job (`again` says None: the retry loop submits one)."""
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'case "$*" in *%r*) echo "{reason}";; *) echo {listed};; esac',
        sacct="echo COMPLETED",
        scancel="exit 0",
    )
    slurm, job = SlurmLauncher(), submitit.SlurmJob(tmp_path, "88")
    assert slurm.end_state(job) == ("REQUEUED", True)
    assert slurm.again(job, "train") is (None if replaced else job)
    assert ("scancel 88" in log.read_text()) == replaced


@pytest.mark.spawns
def test_an_administrators_hold_is_waited_on_with_its_reason_never_cancelled(tmp_path, monkeypatch, capsys):
    """JobHeldAdmin (or JobHeldUser) is someone's decision: `again` gives the job back, `wait` waits until it is
    released and has run, printing the reason once."""
    count = tmp_path / "count"
    state = f'echo x >>{count}; [ "$(wc -l <{count})" -le 3 ] && echo PENDING; exit 0'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'case "$*" in *%r*) echo JobHeldAdmin;; *) {state};; esac',
        sacct="echo COMPLETED",
        scancel="exit 0",
    )
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 0.01)
    slurm, job = SlurmLauncher(), submitit.SlurmJob(tmp_path, "88")
    assert slurm.again(job, "train") is job
    slurm.wait(job, LaunchSpec("slurm", slurm=SlurmSettings(file_system_lag_s=0)), "train")
    assert "scancel" not in log.read_text()
    assert capsys.readouterr().out.count("pends: JobHeldAdmin (held by an administrator") == 1


@pytest.mark.spawns
def test_a_job_that_pends_on_a_reason_no_wait_clears_is_cancelled_and_fails_the_stage(tmp_path, monkeypatch):
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        squeue='case "$*" in *%r*) echo PartitionTimeLimit;; *) echo PENDING;; esac',
        scancel="exit 0",
    )
    with pytest.raises(JobFailed, match=r"train: slurm job 88 pends on PartitionTimeLimit.*resources.time_min"):
        SlurmLauncher().wait(submitit.SlurmJob(tmp_path, "88"), LaunchSpec("slurm"), "train")
    assert "scancel 88" in log.read_text()


@pytest.mark.spawns
def test_a_completed_jobs_results_are_waited_for_on_a_shared_file_system(tmp_path, monkeypatch):
    """NFS shows a result written on the job's node late: `wait` returns once it shows, up to file_system_lag_s."""
    _fake_commands(tmp_path, monkeypatch, squeue="exit 0", sacct="echo COMPLETED")
    monkeypatch.setattr(shared_files, "FILE_POLL_S", 0.01)
    job = submitit.SlurmJob(tmp_path, "88")
    threading.Timer(0.3, cloudpickle_dump, [("success", 5), job.paths.result_pickle]).start()
    SlurmLauncher().wait(job, LaunchSpec("slurm", slurm=SlurmSettings(file_system_lag_s=10)), "train")
    assert job.paths.result_pickle.exists() and SlurmLauncher().results(job) == [5]


@pytest.mark.parametrize(
    ("ended", "runs_again"),
    [("PREEMPTED", True), ("TIMEOUT", True), ("NODE_FAIL", True), ("CANCELLED", False), ("FAILED", False)],
)
@pytest.mark.spawns
def test_a_job_that_ended_under_the_work_runs_again_in_a_new_job_and_one_cancelled_or_failed_does_not(
    tmp_path, monkeypatch, ended, runs_again
):
    """PreemptMode=CANCEL ends a job PREEMPTED, JobRequeue=0 one TIMEOUT, with no result: submitit's wait took
    PREEMPTED for unfinished. `wait` returns on the final state, the end is told, a new job is asked (`again`)."""
    _fake_commands(tmp_path, monkeypatch, squeue="exit 0", sacct=f"echo {ended}")
    slurm, job = SlurmLauncher(), submitit.SlurmJob(tmp_path, "88")
    slurm.wait(job, LaunchSpec("slurm"), "train")
    assert slurm.end_state(job) == (ended, runs_again)
    assert slurm.again(job, "train") is None
