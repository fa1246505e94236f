"""What a stage calls to run its worker on N nodes, locally or through Slurm: `run` (and `run_or_out_of_memory`)
submit the worker (named by a `Worker`) through the launcher its LaunchSpec picks (launchers/), or re-attach to the
job an earlier run of the stage recorded, wait for it, and run the work again where its job ended under it. A job
that ends without a result raises `JobFailed`. Everything that talks to submitit and Slurm is behind this module."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from tula_hpc._legacy_paths import moved_names
from tula_hpc.cluster.job_step_failures import out_of_memory_record
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers import interface, job_record
from tula_hpc.cluster.launchers.interface import JobFailed
from tula_hpc.cluster.launchers.registry import launcher_for

__getattr__ = moved_names(__name__)  # what this module held before the launchers went apart (issue 55)


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


def run(fn: Callable[..., Any], kwargs: dict, spec: LaunchSpec, stage_dir: Path, name: str) -> Any:
    """Run `fn(**kwargs)` on every rank of a fresh (or re-attached) job; return rank 0's result. Work whose job
    ended under it (preempted, its time limit, a lost node) runs again, resuming from its checkpoint, at most
    resources.max_requeues times."""
    launcher = launcher_for(spec)
    task = interface.DistributedTask(fn, kwargs, spec.cpus_per_task, environment=spec.environment)
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    attached = job_record.reattach(stage_dir)
    if attached is not None:
        launcher, job = attached
    else:
        job = job_record.submit(launcher, task, spec, stage_dir, name)
    runs = spec.max_requeues + 1
    for run_number in range(1, runs + 1):
        launcher.wait(job, spec, name)
        try:
            results = launcher.results(job)
            break
        except (FailedJobError, UncompletedJobError) as err:
            state, runs_again = launcher.end_state(job)
            if not runs_again or run_number == runs:
                raise interface.failed(job, spec, name, state, str(err).splitlines()[0] if str(err) else "") from None
            print(
                f"[tula-hpc] {launcher.name} job {job.job_id} ended {state} under {name}: it runs again "
                f"(run {run_number + 1} of at most {runs})",
                flush=True,
            )
            job = launcher.again(job, name) or job_record.submit(launcher, task, spec, stage_dir, name)
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
        record = out_of_memory_record(failure_dir, within_s=launcher_for(spec).file_system_lag_s(spec))
        if record is None:
            raise
        return None, record


def _echo_rank0_output(job: submitit.Job) -> None:
    """Copy rank 0's output into the stage's own log, where users look first."""
    rank0 = job.task(0)
    if rank0.paths.stdout.exists():
        print(rank0.paths.stdout.read_text(errors="replace"), end="", flush=True)
