"""launch: a stage's worker run through its launcher, re-run where its job ended under it, rank 0's output echoed,
and a task pickled before the launchers went apart still loads.

No cluster: fake `sbatch`, `squeue`, `sacct` and `srun` on PATH stand in for Slurm (as in submitit's own tests).
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import submitit
from submitit.core.utils import cloudpickle_dump

from tests.conftest import default_job
from tests.conftest import fake_commands as _fake_commands
from tests.unit.test_shared_allocation_launcher import PARTITION, answer, shared_spec
from tula_hpc.cluster import launch, slurm_states
from tula_hpc.cluster.launchers.interface import DistributedTask


def test_rank_0s_output_is_echoed_into_the_stages_log(tmp_path, capsys):
    job = submitit.SlurmJob(folder=tmp_path, job_id="42", tasks=range(3))
    for rank in range(3):
        paths = job.task(rank).paths
        paths.stdout.parent.mkdir(parents=True, exist_ok=True)
        paths.stdout.write_text(f"out of rank {rank}\n")
    launch._echo_rank0_output(job)
    assert capsys.readouterr().out == "out of rank 0\n"


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
    assert launch.run(answer, {"value": 1}, spec, tmp_path / "work" / "profile", name="profile") == 2
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls if c.startswith("srun")] == ["--jobid=77", "--jobid=78"]
    assert '"job_id": "78"' in (tmp_path / "work" / "profile" / "job.json").read_text()


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


def test_a_task_pickled_when_launch_held_it_loads_as_the_moved_class_and_runs_its_worker():
    """submitit pickled a job's task (with the stage's Worker inside) as tula_hpc.cluster.launch.DistributedTask
    before the launchers went apart (issue 55); a requeued or re-attached job of that time unpickles it."""
    task = DistributedTask(launch.Worker("tests.unit.test_shared_allocation_launcher", "answer"), {"value": 1}, 1)
    moved, old = b"tula_hpc.cluster.launchers.interface", b"tula_hpc.cluster.launch"
    pickled = pickle.dumps(task, protocol=0).replace(moved, old)
    assert b"ctula_hpc.cluster.launch\nDistributedTask\n" in pickled
    loaded = pickle.loads(pickled)
    assert type(loaded) is DistributedTask and loaded.fn == task.fn and loaded.fn(**loaded.kwargs) == 2


@pytest.mark.parametrize(("max_requeues", "completes"), [(1, True), (0, False)])
@pytest.mark.spawns
def test_work_preempted_away_runs_again_in_a_new_job_counted_against_max_requeues(
    tmp_path, monkeypatch, capsys, max_requeues, completes
):
    """PreemptMode=CANCEL ends job 4242 PREEMPTED without a result (submitit's wait would wait for ever); the work
    runs again in job 4243, which leaves its result, while resources.max_requeues allows a second run."""
    result, count = tmp_path / "result.pkl", tmp_path / "sbatch.count"
    cloudpickle_dump(("success", 5), result)
    second = f'cp {result} "$(dirname "$1")/4243_0_result.pkl"; echo "Submitted batch job 4243"'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch=f'echo x >>{count}; [ "$(wc -l <{count})" -eq 1 ] && echo "Submitted batch job 4242" || {{ {second}; }}',
        squeue="exit 0",
        sacct='case "$*" in *4242*) echo PREEMPTED;; *) echo COMPLETED;; esac',
    )
    spec = launch.LaunchSpec("slurm", time_min=5, max_requeues=max_requeues)
    if completes:
        assert launch.run(answer, {"value": 1}, spec, tmp_path / "work" / "train", name="train") == 5
        assert "job 4242 ended PREEMPTED under train: it runs again (run 2 of at most 2)" in capsys.readouterr().out
    else:
        with pytest.raises(launch.JobFailed, match="slurm job 4242 ended PREEMPTED"):
            launch.run(answer, {"value": 1}, spec, tmp_path / "work" / "train", name="train")
    assert log.read_text().count("sbatch ") == 1 + completes
