"""launchers/slurm: the sbatch script submitit writes, a job found again by its id or its name, a job Slurm requeued,
held or pending on a reason no wait clears, one that ended under the work, and results read on a shared file system.

No cluster: fake `sbatch`, `squeue` and `sacct` on PATH stand in for Slurm (as in submitit's own tests).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
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


def _script(tmp_path: Path, **spec) -> list[str]:
    """The lines of the sbatch script submitit would write for `spec` (nothing submitted)."""
    executor = SlurmLauncher().executor(LaunchSpec(launcher="slurm", **spec), tmp_path / "submit", "train")
    return executor._executor._make_submission_file_text("RUN", "0").splitlines()


def test_the_ranks_srun_asks_the_jobs_cores_and_the_job_asks_to_be_requeued(tmp_path):
    """srun inherits no --cpus-per-task from the job in Slurm 22.05 to 23.02: without it, where cgroups confine
    cores, each rank gets one. And --requeue explicitly: where a site's default is JobRequeue=0, submitit's
    `scontrol requeue` at the time-limit warning fails."""
    lines = _script(tmp_path, cpus_per_task=6)
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--cpus-per-task=6" in srun.split() and "#SBATCH --requeue" in lines


def test_no_wckey_unless_one_is_given(tmp_path):
    assert not any("--wckey" in line for line in _script(tmp_path))
    assert "#SBATCH --wckey=proj7" in _script(tmp_path, slurm=SlurmSettings(wckey="proj7"))
    assert "#SBATCH --wckey=''" in _script(tmp_path, slurm=SlurmSettings(extra_args=("--wckey=",)))


def test_extra_arguments_become_whole_sbatch_lines_by_their_long_names(tmp_path):
    """-p gpu is one option of two words (it was one broken line, `#SBATCH --p gpu=True`), --exclusive a bare flag;
    an extra option replaces the key of the same name, never a second line beside it."""
    lines = _script(tmp_path, slurm=SlurmSettings(partition="debug", extra_args=("-p gpu --exclusive", "-q high")))
    parameters = [line for line in lines if line.startswith("#SBATCH")]
    assert {"#SBATCH --partition=gpu", "#SBATCH --exclusive", "#SBATCH --qos=high"} <= set(parameters)
    assert sum("partition" in line for line in parameters) == 1


def test_a_sites_gpu_type_reservation_setup_and_memory_per_gpu(tmp_path):
    slurm = SlurmSettings(
        gpu_type="a100", reservation="maint", mem_per_gpu_gb=16, setup=("module load cuda/12.1", "source site.sh")
    )
    lines = _script(tmp_path, nodes=2, gpus_per_node=4, mem_gb=64, slurm=slurm)
    assert {"#SBATCH --gpus-per-node=a100:4", "#SBATCH --reservation=maint", "#SBATCH --mem-per-gpu=16384M"} <= set(
        lines
    )
    assert not any(line.startswith("#SBATCH --mem=") for line in lines)
    setup = lines.index("# setup")
    assert lines[setup + 1 : setup + 3] == ["module load cuda/12.1", "source site.sh"]
    assert setup < next(i for i, line in enumerate(lines) if line.startswith("srun "))


def test_gpus_bound_one_per_task(tmp_path):
    lines = _script(tmp_path, nodes=2, gpus_per_node=4, slurm=SlurmSettings(gpu_binding="task"))
    assert {"#SBATCH --gpus-per-task=1", "#SBATCH --ntasks-per-node=4"} <= set(lines)
    assert not any("gpus-per-node" in line for line in lines)


def test_the_warning_before_the_time_limit_is_the_one_the_train_stage_measured():
    """submitit's --signal=USR2@<delay>: sized from the checkpoint saves where measured, else today's default."""
    spec = LaunchSpec(launcher="slurm", time_min=60)
    assert SlurmLauncher().shape(spec)["slurm_signal_delay_s"] == 90
    assert SlurmLauncher().shape(replace(spec, stop_warning_s=300))["slurm_signal_delay_s"] == 300


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


@pytest.mark.spawns
def test_a_running_jobs_written_results_end_the_wait_between_looks_at_its_state(tmp_path, monkeypatch):
    """Looks at a running job's state back off to 30 s: the results, looked for between them as submitit's own wait
    does, end the wait once written, not up to 30 s later."""
    _fake_commands(tmp_path, monkeypatch, squeue="echo RUNNING", sacct="echo RUNNING")
    monkeypatch.setattr(shared_files, "FILE_POLL_S", 0.01)
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 30)
    job = submitit.SlurmJob(tmp_path, "88")
    threading.Timer(0.3, cloudpickle_dump, [("success", 5), job.paths.result_pickle]).start()
    started = time.monotonic()
    SlurmLauncher().wait(job, LaunchSpec("slurm"), "train")
    assert time.monotonic() - started < 10 and SlurmLauncher().results(job) == [5]


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
    scontrol = "echo JobId=88 PreemptTime=None"
    _fake_commands(tmp_path, monkeypatch, squeue="exit 0", sacct=f"echo {ended}", scontrol=scontrol)
    slurm, job = SlurmLauncher(), submitit.SlurmJob(tmp_path, "88")
    slurm.wait(job, LaunchSpec("slurm"), "train")
    assert slurm.end_state(job) == (ended, runs_again)
    assert slurm.again(job, "train") is None


@pytest.mark.spawns
def test_a_job_whose_ranks_left_in_its_preemption_grace_time_ran_again(tmp_path, monkeypatch):
    """Under PreemptMode=CANCEL the ranks get SIGTERM at once, save and leave; the job then ends FAILED before its
    GraceTime is over, never PREEMPTED. Slurm's PreemptTime says it was preempted: the work runs again."""
    _fake_commands(
        tmp_path,
        monkeypatch,
        squeue="exit 0",
        sacct="echo FAILED",
        scontrol="echo JobId=88 PreemptTime=2026-11-28T08:55:40 SuspendTime=None",
    )
    assert SlurmLauncher().end_state(submitit.SlurmJob(tmp_path, "88")) == ("PREEMPTED", True)
