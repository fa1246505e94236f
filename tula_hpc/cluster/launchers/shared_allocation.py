"""The shared-allocation launcher: each measurement of the measuring phase a job step (srun --jobid) of its one
allocation (allocation.py), the srun command that starts it, and the step as a submitit job (`StepJob`) that a
rerun finds again by its srun or by its name in the allocation."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import submitit

from tula_hpc.cluster.allocation import ALLOCATION_POLL_S, hold_allocation
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import DistributedTask, Launcher, ended_well, pid_alive
from tula_hpc.cluster.launchers.slurm import SlurmLauncher
from tula_hpc.cluster.slurm_options import as_arguments, resource_options, with_setup
from tula_hpc.cluster.slurm_states import (
    ACTIVE_SLURM_STATES,
    being_preempted,
    run_started,
    settled_state,
    step_running,
    step_state,
)

STEP_POLL_S = 0.5  # how often a step's result files are looked for while its srun runs
STEP_END_GRACE_S = 20  # a step whose results are written is done this long after, whether srun has ended or not


class StepJob(submitit.SlurmJob):
    """A job step of a shared allocation: the allocation's id (submitit's paths are named by it) and the srun
    process on this host that runs the step and ends with it (its pid and start time: a pid alone may be reused)."""

    def __init__(
        self,
        folder: Path,
        job_id: str,
        tasks: Sequence[int] = (0,),
        srun: tuple[int, float] | None = None,
        process: subprocess.Popen | None = None,
        step_name: str = "",
    ):
        super().__init__(folder=folder, job_id=job_id, tasks=tasks)  # submitit makes one per task this way too
        self.srun, self.process, self.step_name = srun, process, step_name

    def srun_alive(self) -> bool:
        if self.srun is None:
            return False
        pid, started = self.srun
        try:
            return pid_alive(pid) and psutil.Process(pid).create_time() == started
        except psutil.Error:
            return False


class SharedAllocationLauncher(SlurmLauncher):
    """Each measurement a job step (srun --jobid) of the measuring phase's one allocation, which waits in the queue
    once. Its srun runs in a session of its own: the step outlives a driver killed with its process group (Slurm
    cancels a running step whose srun dies), and the rerun waits for it, as for a per-stage sbatch job. Step
    options, from srun(1): --exact gives a step only the CPUs it asks for, so a step of fewer nodes or
    tasks than the allocation leaves the rest free; --mem asks for the node memory a measurement needs, so a
    second step waits for it inside the allocation rather than measuring beside another (Slurm blocks a step until
    its resources are free unless --overlap, which is not given: a timed profile must not share its CPUs);
    --time gives the step its own limit (resources.measure_time_min), so a measurement that hangs ends there, not
    with the allocation; --kill-on-bad-exit ends the step when a rank dies, as for the per-stage jobs."""

    name = "slurm_shared"
    again = Launcher.again  # a step is never requeued by itself: it runs again as a new step, in the allocation

    def job_id_ahead(self, spec: LaunchSpec) -> str | None:
        return hold_allocation(spec)

    def submit(
        self, spec: LaunchSpec, folder: Path, name: str, task: DistributedTask, job_id_ahead: str | None = None
    ) -> submitit.Job:
        holder = job_id_ahead or hold_allocation(spec)
        folder.mkdir(parents=True, exist_ok=True)
        task.master_port = random.Random(f"{holder}-{folder}").randrange(20000, 60000)
        submitit.helpers.DelayedSubmission(task).dump(folder / f"{holder}_submitted.pkl")  # submitit's name for it
        with open(folder / "srun.log", "w") as log:
            env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm"}  # what submitit's sbatch script exports
            process = subprocess.Popen(
                step_command(spec, holder, folder, name),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        srun = (process.pid, psutil.Process(process.pid).create_time())
        return StepJob(folder, holder, range(spec.world_size), srun, process, name)

    def record(self, job: submitit.Job) -> dict:
        return {"srun": job.srun}

    def reattach(self, record: dict) -> submitit.Job | None:
        """The step if its srun still runs here, or Slurm still runs it (its driver died before it recorded the
        srun), or it finished with every rank's result: then it is not measured twice."""
        folder, tasks = Path(record["folder"]), range(record["tasks"])
        srun = tuple(record["srun"]) if record.get("srun") else _srun_of(folder)
        job = StepJob(folder, record["job_id"], tasks, srun=srun, step_name=record["name"])
        if job.srun_alive() or step_running(job.job_id, job.step_name):
            return job
        return job if all(ended_well(job, rank) for rank in range(job.num_tasks)) else None

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        """Until the step has ended, or every rank's result has been written for STEP_END_GRACE_S: srun, which ends
        with the step, first tells slurmctld so, and while slurmctld is away (restarted) it retries for a minute or
        more after its return. Normally the step's end is waited for: its accounting then says COMPLETED. A step
        that ended well has its results waited for on a shared file system (resources.slurm.file_system_lag_s)."""
        written_at = None
        while True:
            if job.process is not None:  # our srun
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if job.process.wait(timeout=STEP_POLL_S) == 0:
                        self.results_written(job, within_s=self.file_system_lag_s(spec))
                    return
            elif job.srun_alive() or step_running(job.job_id, job.step_name):  # a re-attached step's
                time.sleep(ALLOCATION_POLL_S)
            else:
                self.results_written(job, within_s=self.file_system_lag_s(spec))
                return
            if all(job.task(rank).paths.result_pickle.exists() for rank in range(job.num_tasks)):
                written_at = written_at or time.time()
                if time.time() - written_at > STEP_END_GRACE_S:
                    return

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """While the allocation runs, the step ended by itself (OUT_OF_MEMORY, FAILED, its own TIMEOUT). Else the
        allocation ended under it (time limit, preemption, a lost node) or went back to the queue (REQUEUED:
        preempted, scontrol requeue): the measurement goes again, once it or a new one runs. The holder does no
        work of its own (it sleeps), so whatever ended it, FAILED included (a lost batch node), ended it under the
        measurement; only an allocation someone cancelled fails the stage. An allocation that runs again since the
        step began was requeued under it (its srun ends only once the lost node's step is cleaned up, and the
        allocation may have started again by then)."""
        state = settled_state(str(job.job_id))
        if state == "RUNNING" and being_preempted(str(job.job_id)):
            return "PREEMPTED", True  # in its grace time: the step was signalled, the allocation ends PREEMPTED
        if state == "RUNNING" and not _requeued_since(job):
            return step_state(str(job.job_id), job.step_name), False
        if state in ACTIVE_SLURM_STATES:
            return "REQUEUED", True
        return state, state != "CANCELLED"


def step_command(spec: LaunchSpec, holder: str, folder: Path, name: str) -> list[str]:
    """The srun that runs one measurement's ranks as a step of allocation `holder` (submitit's runner, its names),
    with the GPUs, memory and setup lines resources.slurm gives the per-stage jobs (slurm_options.py)."""
    cmd = ["srun", f"--jobid={holder}", f"--job-name={name}", f"--nodes={spec.nodes}"]
    cmd += [f"--ntasks-per-node={spec.tasks_per_node}", f"--cpus-per-task={spec.cpus_per_task}"]
    cmd += as_arguments(resource_options(spec.slurm, spec.gpus_per_node, spec.mem_gb))
    cmd += [f"--time={spec.time_min}", "--exact", "--kill-on-bad-exit=1", "--unbuffered"]
    cmd += [f"--output={folder}/%j_%t_log.out", f"--error={folder}/%j_%t_log.err"]
    return cmd + with_setup(spec.slurm.setup, [sys.executable, "-u", "-m", "submitit.core._submit", str(folder)])


def _requeued_since(job: StepJob) -> bool:
    """Whether the allocation's current run began after the step's srun did (known for a step started here)."""
    began = run_started(str(job.job_id))
    return job.srun is not None and began is not None and began > job.srun[1]


def _srun_of(folder: Path) -> tuple[int, float] | None:
    """The srun on this host that runs a step from `folder` (its command names it), as StepJob keeps it: found for
    a record whose driver died before it heard of the srun, which may still wait for the step's resources."""
    for process in psutil.process_iter(["name", "cmdline", "create_time"]):
        command = process.info["cmdline"] or [""]
        if process.info["name"] == "srun" and Path(command[-1]).name == folder.name:  # step_command's last word
            return process.pid, process.info["create_time"]
    return None
