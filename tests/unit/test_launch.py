"""launch: Slurm's words parsed from recorded output, the sbatch script submitit writes, rank logs via submitit's API.

No cluster: fake `sbatch`, `squeue` and `sacct` on PATH stand in for Slurm (as in submitit's own tests).
tests/unit/data/slurm/*.txt were recorded on the local cluster by tests/unit/data/slurm/capture.sh.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import submitit

from tests.conftest import default_job, wait_for
from tests.conftest import fake_commands as _fake_commands
from tests.unit.test_slurm_states import SACCT_STEPS
from tula_hpc.cluster import launch, launch_spec, slurm_states
from tula_hpc.core.job import Job, SlurmSettings

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "slurm"


def _recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def _worker() -> None:
    """Stands in for a stage's worker: the sbatch script names only submitit's runner, not the function."""


@pytest.mark.spawns
def test_the_sbatch_script_matches_the_recorded_one(tmp_path, monkeypatch):
    """What a 2-node GPU job with account, partition and an extra sbatch argument asks of Slurm."""
    submitted = tmp_path / "submitted.sh"
    log = _fake_commands(tmp_path, monkeypatch, sbatch=f'cp "$1" {submitted}; echo "Submitted batch job 4242"')
    spec = launch.LaunchSpec(
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
    executor = launch.LAUNCHERS["slurm"].executor(spec, folder, "train")
    job = executor.submit(launch.DistributedTask(_worker, {}, threads=4))
    assert job.job_id == "4242" and job.num_tasks == spec.world_size == 4
    assert log.read_text().startswith("sbatch ")
    script = submitted.read_text().replace(str(folder.resolve()), "{FOLDER}").replace(sys.executable, "{PYTHON}")
    assert script == (DATA / "sbatch_2_nodes_2_gpus.txt").read_text()


def _slurm_gpu_job() -> Job:
    """A Slurm job on nodes of 4 GPUs."""
    resources = {"gpus_per_node": 4, "cpus_per_task": 8, "mem_gb": 32, "time_min": 60, "max_requeues": 3}
    return default_job().updated(launcher="slurm", resources=resources)


def test_one_device_keeps_at_most_one_gpu_per_node():
    job = _slurm_gpu_job()
    assert launch.LaunchSpec.for_job(job, nodes=2).world_size == 8
    one = launch.LaunchSpec.for_job(job, nodes=2, one_device=True)
    assert (one.gpus_per_node, one.world_size, one.cpus_per_task) == (1, 2, 8)
    cpu_job = job.updated(resources={"gpus_per_node": 0})
    assert launch.LaunchSpec.for_job(cpu_job, one_device=True).gpus_per_node == 0


def test_a_candidates_own_gpus_per_node_sets_the_ranks_on_each_node():
    """A node shape of 2 GPUs on nodes of 4 (search.gpus_per_node): Slurm is asked for 2 tasks and 2 GPUs each."""
    job = _slurm_gpu_job()
    spec = launch.LaunchSpec.for_job(job, nodes=2, gpus_per_node=2)
    assert (spec.gpus_per_node, spec.tasks_per_node, spec.world_size) == (2, 2, 4)
    assert launch.LaunchSpec.for_job(job, nodes=2, gpus_per_node=2, one_device=True).world_size == 2


@pytest.mark.parametrize("tasks", [1, 3])
def test_rank_logs_are_read_through_submitits_tasks(tmp_path, capsys, tasks):
    job = submitit.SlurmJob(folder=tmp_path, job_id="42", tasks=range(tasks))
    for rank in range(tasks):
        paths = job.task(rank).paths
        paths.stdout.parent.mkdir(parents=True, exist_ok=True)
        paths.stdout.write_text(f"out of rank {rank}\n")
        paths.stderr.write_text("".join(f"rank {rank} line {i}\n" for i in range(100)))
    tail = launch._stderr_tail(job)
    assert [f"rank {rank} line 99" in tail for rank in range(tasks)] == [True] * tasks
    assert "line 59\n" not in tail and f"line {100 - launch.STDERR_TAIL_LINES}\n" in tail
    launch._echo_rank0_output(job)
    assert capsys.readouterr().out == "out of rank 0\n"


@pytest.mark.spawns
def test_gpus_per_node_asks_slurm_for_one_task_per_gpu(tmp_path, monkeypatch):
    """gpus_per_node=2: two tasks on each node, one per GPU (each rank's LOCAL_RANK picks its device)."""
    submitted = tmp_path / "submitted.sh"
    _fake_commands(tmp_path, monkeypatch, sbatch=f'cp "$1" {submitted}; echo "Submitted batch job 4243"')
    spec = launch.LaunchSpec(launcher="slurm", nodes=2, gpus_per_node=2)
    job = (
        launch.LAUNCHERS[spec.launcher]
        .executor(spec, tmp_path / "submit", "train")
        .submit(launch.DistributedTask(_worker, {}, threads=1))
    )
    lines = submitted.read_text().splitlines()
    assert "#SBATCH --gpus-per-node=2" in lines and "#SBATCH --ntasks-per-node=2" in lines
    assert "#SBATCH --nodes=2" in lines and job.num_tasks == 4


@pytest.mark.parametrize(("nodes", "gpus", "visible"), [(2, 1, "0,1"), (2, 2, "0,1,2,3"), (2, 0, "")])
def test_the_local_launcher_shows_each_rank_a_gpu_of_its_own(tmp_path, nodes, gpus, visible):
    """submitit's local executor makes GPUs 0 to gpus_per_node - 1 visible to all its processes: the N "nodes"
    it runs need the GPUs of them all, or ranks beyond the first node's find none."""
    executor = launch.LAUNCHERS["local"].executor(
        launch.LaunchSpec("local", nodes=nodes, gpus_per_node=gpus), tmp_path, "train"
    )
    shown = executor._executor.parameters["gpus_per_node"]
    assert ",".join(map(str, range(shown))) == visible


PARTITION = "PartitionName=debug Default=YES MaxNodes=UNLIMITED MaxTime=04:00:00 TotalNodes=2 TRES=cpu=4,node=2"


def shared_spec(tmp_path: Path, nodes: int = 1) -> launch.LaunchSpec:
    """A measurement of `nodes` nodes in a 2-node shared allocation recorded under tmp_path/work/allocation."""
    shared = launch_spec.Allocation(str(tmp_path / "work" / "allocation"), nodes=2, gpus_per_node=0, time_min=60)
    slurm = SlurmSettings(partition="debug")
    return launch.LaunchSpec("slurm", nodes=nodes, mem_gb=1, time_min=20, slurm=slurm, allocation=shared)


def test_a_measurement_step_asks_slurm_for_what_the_docs_say():
    spec = shared_spec(Path("/w"), nodes=2)
    step = launch.step_command(spec, "77", Path("/w/profile"), "job-profile")
    assert step[:4] == ["srun", "--jobid=77", "--job-name=job-profile", "--nodes=2"]
    assert {"--exact", "--mem=1024M", "--time=20", "--kill-on-bad-exit=1", "--ntasks-per-node=1"} <= set(step)
    assert "--overlap" not in step and step[-4:] == ["-u", "-m", "submitit.core._submit", "/w/profile"]


def _answer(value: int) -> int:
    return value + 1


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
    assert launch.run(_answer, {"value": 41}, spec, tmp_path / "work" / "profile", name="profile") == 42
    record = (tmp_path / "work" / "profile" / "job.json").read_text()
    assert '"launcher": "slurm_shared"' in record and '"job_id": "77"' in record


@pytest.mark.spawns
def test_a_step_whose_allocation_timed_out_runs_again_in_a_new_one(tmp_path, monkeypatch):
    """The first allocation (77) reaches its time limit while the step runs (the fake srun leaves no result and
    accounting says TIMEOUT); the measurement is taken again in allocation 78, and its result returned."""
    srun = (
        'case "$1" in --jobid=77) exit 1;; esac\n'
        'while [ "${1#--}" != "$1" ]; do shift; done\n'
        "export SLURM_JOB_ID=78 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_NODEID=0\n"
        "export SLURM_JOB_NUM_NODES=1 SLURM_JOB_NODELIST=n1\n"
        'exec "$@"'
    )
    count = tmp_path / "sbatch.count"
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch=f'echo x >>{count}; [ "$(wc -l <{count})" -eq 1 ] && echo 77 || echo 78',
        squeue=f'[ "$3" = 77 ] && [ -e {tmp_path}/ended ] && exit 0; echo RUNNING',
        sacct="echo TIMEOUT",
        scancel="exit 0",
        scontrol=f"echo '{PARTITION}'",
        srun=f'[ "$1" = --jobid=77 ] && touch {tmp_path}/ended\n{srun}',
    )
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.05)
    spec = shared_spec(tmp_path)
    assert launch.run(_answer, {"value": 1}, spec, tmp_path / "work" / "profile", name="profile") == 2
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls if c.startswith("srun")] == ["--jobid=77", "--jobid=78"]
    assert '"job_id": "78"' in (tmp_path / "work" / "profile" / "job.json").read_text()


@pytest.mark.spawns
def test_a_reattached_step_is_waited_for_as_a_step_whatever_the_spec_says_now(tmp_path, capsys):
    """A step of a shared allocation, still running when the stage is rerun with allocation per_stage: it is waited
    for and its result read as a step's (no sbatch job of that id to ask Slurm about)."""
    from submitit.core.utils import cloudpickle_dump

    stage_dir, folder = tmp_path / "profile", tmp_path / "profile" / "submit-x"
    folder.mkdir(parents=True)
    cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")
    step = subprocess.Popen(["sleep", "0.3"])
    srun = [step.pid, psutil.Process(step.pid).create_time()]
    record = {"launcher": "slurm_shared", "name": "profile", "srun": srun, "job_id": "77", "folder": str(folder)}
    record["tasks"] = 1
    (stage_dir / "job.json").write_text(json.dumps(record))
    assert launch.run(_answer, {"value": 0}, launch.LaunchSpec("slurm"), stage_dir, name="profile") == 5
    assert "re-attached to slurm_shared job 77" in capsys.readouterr().out
    step.wait()


@pytest.mark.parametrize(
    ("allocation", "expected"),
    [("RUNNING", ("OUT_OF_MEMORY", False)), ("PENDING", ("REQUEUED", True)), ("", ("TIMEOUT", True))],
)
@pytest.mark.spawns
def test_a_failed_step_is_told_from_the_allocation_ending_or_going_back_to_the_queue(
    tmp_path, monkeypatch, allocation, expected
):
    """The step's own end while the allocation runs (the stage fails); REQUEUED while it is queued again and the
    allocation's end (accounting says TIMEOUT) once Slurm has let it go (the measurement goes again)."""
    sacct = f'case "$*" in *JobName*) printf "{SACCT_STEPS}";; *) echo TIMEOUT;; esac'
    _fake_commands(tmp_path, monkeypatch, squeue=f"echo {allocation}", sacct=sacct)
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.05)
    step = launch.StepJob(tmp_path, "77", step_name="job-profile-N1-B32")
    assert launch.LAUNCHERS["slurm_shared"].end_state(step) == expected


@pytest.mark.spawns
def test_a_step_whose_srun_is_gone_is_waited_for_in_slurm_not_measured_again(tmp_path, monkeypatch):
    """The record's srun is gone (its pid now another process's); Slurm still lists the step (twice), then not; its
    result is read, nothing is submitted. A step that finished while no driver ran is read the same way."""
    from submitit.core.utils import cloudpickle_dump

    count = tmp_path / "count"
    log = _fake_commands(
        tmp_path, monkeypatch, squeue=f'echo x >>{count}; [ "$(wc -l <{count})" -le 2 ] && echo job-profile; exit 0'
    )
    monkeypatch.setattr(launch, "ALLOCATION_POLL_S", 0.01)
    stage_dir, folder = tmp_path / "profile", tmp_path / "profile" / "submit-x"
    folder.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "30"])
    srun = [other.pid, psutil.Process(other.pid).create_time() - 60]  # the pid, reused
    record = {"launcher": "slurm_shared", "name": "job-profile", "srun": srun, "job_id": "77"}
    (stage_dir / "job.json").write_text(json.dumps({**record, "folder": str(folder), "tasks": 1}))
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\nexit 1\n")  # a submission would fail the test
    cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")
    assert launch.run(_answer, {"value": 0}, launch.LaunchSpec("slurm"), stage_dir, name="job-profile") == 5
    assert log.read_text().count("squeue -h -s -j 77") == 3  # reattach, then wait until it is gone
    assert launch.run(_answer, {"value": 0}, launch.LaunchSpec("slurm"), stage_dir, name="job-profile") == 5
    other.kill()


@pytest.mark.spawns
def test_the_job_is_recorded_before_it_starts_so_a_driver_killed_as_it_starts_leaves_a_record(tmp_path, monkeypatch):
    """A driver killed after srun started a step and before it wrote the step's record: the rerun found no record
    and measured again beside the orphan (CI saw a profile run twice). The record is written first, with the
    allocation's id; the rerun finds the step by its name in the allocation and waits for it."""
    from submitit.core.utils import cloudpickle_dump

    squeue = 'case "$*" in *" -s "*) exit 0;; *) echo RUNNING;; esac'  # the allocation runs, the step has ended
    log = _fake_commands(
        tmp_path, monkeypatch, sbatch="echo 77", squeue=squeue, srun="exit 1", scontrol=f"echo '{PARTITION}'"
    )
    spec, stage_dir = shared_spec(tmp_path), tmp_path / "profile"
    shared = launch.LAUNCHERS["slurm_shared"]

    def killed_as_it_starts(spec, folder, name, task, job_id_ahead=None):
        recorded = json.loads((stage_dir / "job.json").read_text())
        assert (recorded["job_id"], recorded["name"], recorded.get("srun")) == ("77", "job-profile", None)
        assert recorded["folder"] == str(folder.resolve())
        folder.mkdir(parents=True)
        cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")  # the orphan step measures
        raise KeyboardInterrupt

    monkeypatch.setattr(shared, "submit", killed_as_it_starts)
    with pytest.raises(KeyboardInterrupt):
        launch.run(_answer, {"value": 0}, spec, stage_dir, name="job-profile")
    monkeypatch.setattr(shared, "submit", type(shared).submit.__get__(shared))
    assert launch.run(_answer, {"value": 0}, spec, stage_dir, name="job-profile") == 5
    assert "srun" not in log.read_text()  # not measured again


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
        job = launch.LAUNCHERS["slurm_shared"].reattach({**record, "tasks": 1})
        assert job.srun == (waiting.pid, psutil.Process(waiting.pid).create_time()) and job.srun_alive()
    finally:
        waiting.kill()


@pytest.mark.spawns
def test_an_sbatch_job_whose_driver_died_before_recording_its_id_is_found_by_name_and_folder(tmp_path, monkeypatch):
    folder = tmp_path / "train" / "submit-20261125-0731-cc22dd"
    listed = f"537|{folder}/.submission_file_0d9e1f22.sh"
    log = _fake_commands(
        tmp_path, monkeypatch, squeue=f'case "$*" in *--name*) echo "{listed}";; *) echo RUNNING;; esac'
    )
    record = {"launcher": "slurm", "name": "job-train", "job_id": None, "folder": str(folder), "tasks": 1}
    assert launch.LAUNCHERS["slurm"].reattach(record).job_id == "537"
    assert "squeue -h --name=job-train -o %i|%o" in log.read_text()
    assert launch.LAUNCHERS["local"].reattach(record) is None  # a local job dies with its driver


@pytest.mark.spawns
def test_a_step_whose_results_are_written_is_done_after_a_grace_though_slurm_still_lists_it(tmp_path, monkeypatch):
    """A step's end waits on slurmctld (restarted: srun retries for a minute or more); its written results are read
    STEP_END_GRACE_S after they appeared."""
    from submitit.core.utils import cloudpickle_dump

    _fake_commands(tmp_path, monkeypatch, squeue="echo job-profile")  # listed for ever
    monkeypatch.setattr(launch, "ALLOCATION_POLL_S", 0.01)
    monkeypatch.setattr(launch, "STEP_END_GRACE_S", 0.05)
    step = launch.StepJob(tmp_path, "77", step_name="job-profile")
    cloudpickle_dump(("success", 5), tmp_path / "77_0_result.pkl")
    launch.LAUNCHERS["slurm_shared"].wait(step, launch.LaunchSpec("slurm"), "profile")
    assert launch.LAUNCHERS["slurm_shared"].results(step) == [5]


@pytest.mark.parametrize(
    ("listed", "reason", "submitted"),
    [("PENDING", "BeginTime", False), ("RUNNING", "None", False), ("PENDING", "launch failed requeued held", True)],
)
@pytest.mark.spawns
def test_a_slurm_job_slurm_requeued_itself_is_waited_for_and_replaced_only_where_it_is_held(
    tmp_path, monkeypatch, listed, reason, submitted
):
    """A lost node ends the job NODE_FAIL and Slurm queues it again under the same id (submitit's watcher took the
    first end for the last). Queued or running again, it is waited for while squeue lists it; held (a failed
    launch) it is cancelled and the work goes in a new job."""
    count = tmp_path / "count"
    state = f'echo x >>{count}; [ "$(wc -l <{count})" -le 3 ] && echo {listed}; exit 0'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'case "$*" in *%r*) echo "{reason}";; *) {state};; esac',
        sacct="echo COMPLETED",
        scancel="exit 0",
    )
    monkeypatch.setattr(launch, "REQUEUED_POLL_S", 0.01)
    replacement = object()
    monkeypatch.setattr(launch, "_submit", lambda *args: replacement)
    slurm, job = launch.LAUNCHERS["slurm"], submitit.SlurmJob(tmp_path, "88")
    assert slurm.end_state(job) == ("REQUEUED", True)  # the first squeue
    again = slurm.again(job, None, launch.LaunchSpec("slurm"), tmp_path, "train")
    assert again is (replacement if submitted else job)
    assert ("scancel 88" in log.read_text()) == submitted
    if not submitted:
        assert count.read_text().count("x") == 4  # listed twice more, then gone
        assert slurm.end_state(job) == ("COMPLETED", False)


def _allocator_settings() -> str | None:
    """What a launched rank's torch would read as its CUDA caching allocator's settings."""
    import os

    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


@pytest.mark.spawns
def test_a_gpu_jobs_allocator_settings_reach_every_launched_process(tmp_path, monkeypatch):
    """resources.cuda_alloc_conf is exported before torch sets up CUDA, whatever the driver's environment says;
    a CPU job exports none."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the login shell's
    gpu_job = default_job().updated(resources={"gpus_per_node": 1})
    spec = launch.LaunchSpec.for_job(gpu_job)
    assert spec.environment == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert launch.LaunchSpec.for_job(default_job()).environment == {}
    local = dataclasses.replace(spec, gpus_per_node=0)  # this machine has no GPU; the environment travels alike
    assert launch.run(_allocator_settings, {}, local, tmp_path, "alloc") == "expandable_segments:True"
