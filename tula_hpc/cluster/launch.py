"""The one place that talks to submitit: run a stage's worker on N nodes, locally or through Slurm.

Each way of running a job is a `Launcher` (as submitit has an executor per cluster): `local` runs N "nodes" as N
processes on this machine (one gloo group); `slurm` submits an sbatch job of N nodes; `slurm_shared` runs a
measurement as a step of the measuring phase's allocation (allocation.py). Either way the stage records the job
beside its work folder (before it starts, and once submitted), and waits; a rerun of the stage re-attaches to a job
that is still running instead of submitting a duplicate. What a job asks for is a LaunchSpec (launch_spec.py).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError, pickle_load

from tula_hpc.cluster.allocation import ALLOCATION_POLL_S, hold_allocation
from tula_hpc.cluster.job_step_failures import out_of_memory_record
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.slurm_states import (
    ACTIVE_SLURM_STATES,
    cancel,
    held,
    settled_state,
    slurm_state,
    step_running,
    step_state,
    submitted_from,
)
from tula_hpc.core.atomic_files import read_json, write_json

STDERR_TAIL_LINES = 40
BAD_EXIT_POLL_S = 0.1
STEP_POLL_S = 0.5  # how often a step's result files are looked for while its srun runs
STEP_END_GRACE_S = 20  # a step whose results are written is done this long after, whether srun has ended or not
ALLOCATION_REPLACEMENTS = 2  # times a stage's work may run again after its job ended under it
REQUEUED_POLL_S = 5.0  # how often a job Slurm requeued is looked at until it has run again


class JobFailed(RuntimeError):
    """A stage's job ended without a result; the message names the state, the job id and the log."""


@dataclass(frozen=True)
class Worker:
    """A stage's worker named by module and function and imported where it runs, on the job's nodes: the stage that
    submits it and waits (on a login node, one process per measurement in flight) need not import torch."""

    module: str
    function: str

    def load(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.function)

    def __call__(self, **kwargs: Any) -> Any:
        return self.load()(**kwargs)


class DistributedTask(submitit.helpers.Checkpointable):
    """Exports torch.distributed's environment, then runs the worker; requeues itself on preemption."""

    def __init__(
        self,
        fn: Callable[..., Any],
        kwargs: dict,
        threads: int,
        master_port: int | None = None,
        environment: dict[str, str] | None = None,
    ):
        self.fn, self.kwargs, self.threads, self.master_port = fn, kwargs, threads, master_port
        self.environment = environment or {}

    def __call__(self) -> Any:
        # A job step of a shared allocation: its own nodes, not the allocation's, make the process group
        for job_var, step_var in (
            ("SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"),
            ("SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES"),
        ):
            if step_var in os.environ:
                os.environ[job_var] = os.environ[step_var]
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        if self.master_port is not None:  # submitit derives the port from the job id, which the steps share
            os.environ["MASTER_PORT"] = str(self.master_port)
        os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))
        os.environ.update(self.environment)  # before CUDA is set up: the caching allocator reads it then
        import torch

        if (settings := self.environment.get("PYTORCH_CUDA_ALLOC_CONF")) and torch.cuda.is_available():
            # torch may have been imported (and its settings read) before this call: set them in it too, as
            # PyTorch's own expandable-segments tests do
            torch.cuda.memory._set_allocator_settings(settings)

        torch.set_num_threads(self.threads)
        return self.fn(**self.kwargs)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue the same task: a worker that checkpoints (training) resumes from its checkpoint."""
        return submitit.helpers.DelayedSubmission(self)


class Launcher:
    """How a stage's job is started, found again and waited for: one subclass per way of running it, as submitit
    has an executor per cluster. `LAUNCHERS` maps the profile's launcher name to one."""

    name = ""

    def executor(self, spec: LaunchSpec, folder: Path, name: str) -> submitit.AutoExecutor:
        executor = submitit.AutoExecutor(folder=folder, cluster=self.name, slurm_max_num_timeout=spec.max_requeues)
        params = dict(name=name, timeout_min=spec.time_min, cpus_per_task=spec.cpus_per_task, **self.shape(spec))
        executor.update_parameters(**{k: v for k, v in params.items() if v not in (None, "")})
        return executor

    def job_id_ahead(self, spec: LaunchSpec) -> str | None:
        """The id the job will run under where it is known before the job starts, else None."""
        return None

    def submit(
        self, spec: LaunchSpec, folder: Path, name: str, task: DistributedTask, job_id_ahead: str | None = None
    ) -> submitit.Job:
        return self.executor(spec, folder, name).submit(task)

    def shape(self, spec: LaunchSpec) -> dict[str, Any]:
        """submitit's parameters for the job's nodes, tasks and devices."""
        raise NotImplementedError

    def results(self, job: submitit.Job) -> list[Any]:
        """Every rank's result (submitit's FailedJobError or UncompletedJobError when a rank has none)."""
        return job.results()

    def reattach(self, record: dict) -> submitit.Job | None:
        """The job an earlier run of the stage recorded (job.json), if it is still running."""
        raise NotImplementedError

    def record(self, job: submitit.Job) -> dict:
        """What job.json keeps of a submitted job beside its id, for `reattach`."""
        return {}

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        """Return once the job's results can be read (submitit's own wait follows)."""

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """How a job without results ended, and whether it ended under the work (which then runs again: `again`)
        rather than by it (the stage fails)."""
        return "FAILED", False

    def again(self, job: submitit.Job, task: DistributedTask, spec: LaunchSpec, stage_dir: Path, name: str):
        """The job that runs the work again after `job` ended under it: a new one."""
        return _submit(self, task, spec, stage_dir, name)


class LocalLauncher(Launcher):
    """N "nodes" as N processes of one submitit local job on this machine (one gloo or NCCL group)."""

    name = "local"

    def shape(self, spec: LaunchSpec) -> dict[str, Any]:
        # submitit's local executor has no nodes: N nodes become N processes of one "node", which sees the GPUs
        # of them all (it makes GPUs 0 to gpus_per_node - 1 visible), one per rank.
        gpus = spec.world_size if spec.gpus_per_node else 0
        return dict(nodes=1, tasks_per_node=spec.world_size, gpus_per_node=gpus)

    def reattach(self, record: dict) -> submitit.Job | None:
        if record["job_id"] is None:  # its driver died as it started the job: the job died with it
            return None
        pid = int(record["job_id"])
        if not _pid_alive(pid):
            return None
        while _pid_alive(pid):
            time.sleep(0.5)
        return submitit.local.local.LocalJob(
            folder=Path(record["folder"]), job_id=record["job_id"], tasks=range(record["tasks"])
        )

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        _end_at_first_bad_exit(job)
        missing = [rank for rank in range(job.num_tasks) if not job.task(rank).paths.result_pickle.exists()]
        if missing:  # known at once on this disk: no need for submitit's wait for results on a slow file system
            raise _failed(job, spec, name, "FAILED", f"no result from rank(s) {missing}")


class SlurmLauncher(Launcher):
    """One sbatch job of N nodes per stage run."""

    name = "slurm"

    def shape(self, spec: LaunchSpec) -> dict[str, Any]:
        slurm = spec.slurm
        extra = {}
        for arg in slurm.extra_args or ():
            key, _, value = arg.lstrip("-").partition("=")
            extra[key] = value or True  # a bare flag (--exclusive): submitit writes True as `--key`
        return dict(
            nodes=spec.nodes,
            tasks_per_node=spec.tasks_per_node,
            gpus_per_node=spec.gpus_per_node or None,
            mem_gb=spec.mem_gb,
            slurm_partition=slurm.partition,
            slurm_account=slurm.account,
            slurm_qos=slurm.qos,
            slurm_constraint=slurm.constraint,
            slurm_additional_parameters=extra or None,
            # One dead rank ends the whole step at once instead of leaving the others in a collective.
            slurm_srun_args=["--kill-on-bad-exit=1"],
            # The warning before the time limit must leave time to work: a quarter of short limits, 90 s at most.
            slurm_signal_delay_s=min(90, spec.time_min * 60 // 4),
        )

    def reattach(self, record: dict) -> submitit.Job | None:
        """The recorded job while active; one whose driver died before it heard the id is found by name and folder."""
        job_id = record["job_id"] or submitted_from(record["name"], record["folder"])
        if job_id is None or slurm_state(job_id) not in ACTIVE_SLURM_STATES:
            return None
        return submitit.SlurmJob(folder=Path(record["folder"]), job_id=job_id, tasks=range(record["tasks"]))

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """A job still active has been requeued by Slurm itself (a node it ran on failed, JobRequeue): it runs
        again. submitit's own requeues (time limit, preemption) happen inside the job and never end it."""
        state = settled_state(str(job.job_id))
        return ("REQUEUED", True) if state in ACTIVE_SLURM_STATES else (state, False)

    def again(self, job: submitit.Job, task: DistributedTask, spec: LaunchSpec, stage_dir: Path, name: str):
        """The same job, once it has run again (submitit's watcher took its first end for its last: sacct said
        NODE_FAIL). A requeued job that starts while its earlier run's step still ends on a node that came back
        fails to launch and is requeued held, to wait for an admin (the local cluster showed it): a held one is
        cancelled and the work goes in a new job (training resumes from its checkpoint)."""
        job_id = str(job.job_id)
        while (state := settled_state(job_id)) in ACTIVE_SLURM_STATES:
            if state == "PENDING" and held(job_id):
                print(f"[tula-hpc] slurm job {job_id} is held: cancelled, and {name} goes in a new job", flush=True)
                cancel(job_id)
                return _submit(self, task, spec, stage_dir, name)
            time.sleep(REQUEUED_POLL_S)
        return job


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
            return _pid_alive(pid) and psutil.Process(pid).create_time() == started
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
        return job if all(_ended_well(job, rank) for rank in range(job.num_tasks)) else None

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        """Until the step has ended, or every rank's result has been written for STEP_END_GRACE_S: srun, which ends
        with the step, first tells slurmctld so, and while slurmctld is away (restarted) it retries for a minute or
        more after its return. Normally the step's end is waited for: its accounting then says COMPLETED."""
        written_at = None
        while True:
            if job.process is not None:  # our srun
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.process.wait(timeout=STEP_POLL_S)
                    return
            elif job.srun_alive() or step_running(job.job_id, job.step_name):  # a re-attached step's
                time.sleep(ALLOCATION_POLL_S)
            else:
                return
            if all(job.task(rank).paths.result_pickle.exists() for rank in range(job.num_tasks)):
                written_at = written_at or time.time()
                if time.time() - written_at > STEP_END_GRACE_S:
                    return

    def results(self, job: submitit.Job) -> list[Any]:
        """Read from the result files at once: the allocation, which submitit would wait for, runs on."""
        outcomes = []
        for rank in range(job.num_tasks):
            path = job.task(rank).paths.result_pickle
            outcome = pickle_load(path) if path.exists() else ("error", f"rank {rank} left no result")
            if outcome[0] != "success":
                raise FailedJobError(str(outcome[1]))
            outcomes.append(outcome[1])
        return outcomes

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """While the allocation runs, the step ended by itself (OUT_OF_MEMORY, FAILED, its own TIMEOUT). Else the
        allocation ended under it (time limit, preemption, a lost node) or went back to the queue (REQUEUED:
        preempted, scontrol requeue): the measurement goes again, once it or a new one runs. An allocation someone
        cancelled fails the stage."""
        state = settled_state(str(job.job_id))
        if state == "RUNNING":
            return step_state(str(job.job_id), job.step_name), False
        return ("REQUEUED" if state in ACTIVE_SLURM_STATES else state), state != "CANCELLED"


def step_command(spec: LaunchSpec, holder: str, folder: Path, name: str) -> list[str]:
    """The srun that runs one measurement's ranks as a step of allocation `holder` (submitit's runner, its names)."""
    cmd = ["srun", f"--jobid={holder}", f"--job-name={name}", f"--nodes={spec.nodes}"]
    cmd += [f"--ntasks-per-node={spec.tasks_per_node}", f"--cpus-per-task={spec.cpus_per_task}"]
    cmd += [f"--mem={math.ceil(spec.mem_gb * 1024)}M", f"--time={spec.time_min}", "--exact", "--kill-on-bad-exit=1"]
    cmd.append("--unbuffered")
    if spec.gpus_per_node:
        cmd.append(f"--gpus-per-node={spec.gpus_per_node}")
    cmd += [f"--output={folder}/%j_%t_log.out", f"--error={folder}/%j_%t_log.err"]
    return cmd + [sys.executable, "-u", "-m", "submitit.core._submit", str(folder)]


LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher for launcher in (LocalLauncher(), SlurmLauncher(), SharedAllocationLauncher())
}


def launcher_for(spec: LaunchSpec) -> Launcher:
    return LAUNCHERS["slurm_shared" if spec.allocation else spec.launcher]


def _srun_of(folder: Path) -> tuple[int, float] | None:
    """The srun on this host that runs a step from `folder` (its command names it), as StepJob keeps it: found for
    a record whose driver died before it heard of the srun, which may still wait for the step's resources."""
    for process in psutil.process_iter(["name", "cmdline", "create_time"]):
        command = process.info["cmdline"] or [""]
        if process.info["name"] == "srun" and Path(command[-1]).name == folder.name:  # step_command's last word
            return process.pid, process.info["create_time"]
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _stderr_tail(job: submitit.Job) -> str:
    tails = []
    for rank in range(job.num_tasks):
        path = job.task(rank).paths.stderr
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
            tails.append(f"--- {path} (last {len(lines)} lines) ---\n" + "\n".join(lines))
    return "\n".join(tails)


def _submit(launcher: Launcher, task: DistributedTask, spec: LaunchSpec, stage_dir: Path, name: str) -> submitit.Job:
    """Submit the task in a fresh folder and record the job beside the stage's work (job.json) for a rerun: first
    before it starts (with its id where known ahead, a shared allocation's), so that a driver killed while the job
    starts leaves a record its rerun finds the job by, then with the id and what the launcher keeps of it."""
    folder = stage_dir / f"submit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job_id_ahead = launcher.job_id_ahead(spec)
    record = {
        "launcher": launcher.name,
        "name": name,
        "job_id": job_id_ahead,
        "folder": str(folder.resolve()),
        "tasks": spec.world_size,
        "nodes": spec.nodes,
        "submitted": time.time(),
    }
    write_json(stage_dir / "job.json", record)
    job = launcher.submit(spec, folder, name, task, job_id_ahead)
    write_json(stage_dir / "job.json", {**record, "job_id": str(job.job_id), **launcher.record(job)})
    print(
        f"[tula-hpc] submitted {launcher.name} job {job.job_id} ({spec.nodes} node(s), {spec.world_size} task(s)); "
        f"logs in {folder}",
        flush=True,
    )
    return job


def run(fn: Callable[..., Any], kwargs: dict, spec: LaunchSpec, stage_dir: Path, name: str) -> Any:
    """Run `fn(**kwargs)` on every rank of a fresh (or re-attached) job; return rank 0's result. A step whose
    shared allocation ended under it (time limit, preemption, a lost node) runs again in a new one."""
    launcher = launcher_for(spec)
    task = DistributedTask(fn, kwargs, spec.cpus_per_task, environment=spec.environment)
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    record_path = stage_dir / "job.json"
    record = read_json(record_path) if record_path.exists() else None
    job = LAUNCHERS[record["launcher"]].reattach(record) if record else None
    if job is not None:
        launcher = LAUNCHERS[record["launcher"]]  # the job is of the kind recorded, whatever the settings say now
        print(f"[tula-hpc] re-attached to {record['launcher']} job {job.job_id} of an earlier run", flush=True)
    else:
        job = _submit(launcher, task, spec, stage_dir, name)
    for replacements in range(ALLOCATION_REPLACEMENTS + 1):
        launcher.wait(job, spec, name)
        try:
            results = launcher.results(job)
            break
        except (FailedJobError, UncompletedJobError) as err:
            state, runs_again = launcher.end_state(job)
            if not runs_again or replacements == ALLOCATION_REPLACEMENTS:
                raise _failed(job, spec, name, state, str(err).splitlines()[0] if str(err) else "") from None
            print(f"[tula-hpc] {launcher.name} job {job.job_id} ended {state} under {name}: it runs again", flush=True)
            job = launcher.again(job, task, spec, stage_dir, name)
    _echo_rank0_output(job)
    return results[0]


def run_or_out_of_memory(
    fn: Callable[..., Any], kwargs: dict, spec: LaunchSpec, stage_dir: Path, name: str
) -> tuple[Any, dict | None]:
    """`run` a worker that takes `failure_dir` (job_step_failures.out_of_memory_ends_job_step): (rank 0's result, None),
    or (None, the record of the rank that ran out of memory and ended the job step). Any other failure is raised."""
    failure_dir = Path(stage_dir) / "failures" / uuid.uuid4().hex[:12]
    try:
        return run(fn, {**kwargs, "failure_dir": str(failure_dir)}, spec, stage_dir, name), None
    except JobFailed:
        record = out_of_memory_record(failure_dir)
        if record is None:
            raise
        return None, record


def _failed(job: submitit.Job, spec: LaunchSpec, name: str, state: str, detail: str) -> JobFailed:
    where = f"{name}: {spec.launcher} job {job.job_id} ended {state}; read {job.paths.stderr}"
    return JobFailed(f"{where}\n{_stderr_tail(job)}\n{detail}")


def _ended_well(job: submitit.Job, rank: int) -> bool:
    """A rank that left its result behind, and not an error: submitit pickles ("success", result)."""
    path = job.task(rank).paths.result_pickle
    return path.exists() and pickle_load(path)[0] == "success"


def _end_at_first_bad_exit(job: submitit.Job) -> None:
    """What `srun --kill-on-bad-exit` does on Slurm, for the local launcher: once a rank has ended without a
    successful result (an error, a deliberate non-zero exit, a kill), end every other rank of the job.

    submitit's local controller would wait for all of them, and the others may wait for the one that left
    in a collective that never completes. The tasks are the controller's children; a new set of them is a
    requeue (the controller restarts every task), which starts the count afresh.
    """
    controller = psutil.Process(int(job.job_id))
    seen: set[int] = set()
    while not job.done():
        try:
            alive = {c.pid for c in controller.children() if c.status() != psutil.STATUS_ZOMBIE}
        except psutil.NoSuchProcess:
            return
        if alive and alive.isdisjoint(seen):
            seen = set()
        seen |= alive
        ended = len(seen - alive)
        # Results are read only once a rank has ended, not on every poll of a job that runs for hours.
        if alive and ended and ended > sum(_ended_well(job, rank) for rank in range(job.num_tasks)):
            for pid in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()
        time.sleep(BAD_EXIT_POLL_S)


def _echo_rank0_output(job: submitit.Job) -> None:
    """Copy rank 0's output into the stage's own log, where users look first."""
    rank0 = job.task(0)
    if rank0.paths.stdout.exists():
        print(rank0.paths.stdout.read_text(errors="replace"), end="", flush=True)
