"""What every launcher implements (`Launcher`), the task it runs on each rank (`DistributedTask`), and how a job that
ended without a result is told (`JobFailed`, with the ranks' last stderr lines): one interface, as submitit has one
executor interface for every cluster, so the retry loop (launch.py) never asks which launcher it holds."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import pickle_load

from tula_hpc.cluster.launch_spec import LaunchSpec

STDERR_TAIL_LINES = 40


class JobFailed(RuntimeError):
    """A stage's job ended without a result; the message names the state, the job id and the log."""


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
    has an executor per cluster. The registry (registry.py) maps the profile's launcher name to one."""

    name = ""

    def executor(self, spec: LaunchSpec, folder: Path, name: str) -> submitit.AutoExecutor:
        executor = submitit.AutoExecutor(folder=folder, cluster=self.name, slurm_max_num_timeout=spec.max_requeues)
        params = dict(name=name, timeout_min=spec.time_min, cpus_per_task=spec.cpus_per_task, **self.shape(spec))
        executor.update_parameters(**{k: v for k, v in params.items() if v not in (None, "")})
        # AutoExecutor takes None for "not given": a cluster's own parameter the shape sets to None unsets
        # submitit's default on the cluster's executor itself (slurm_wckey: no --wckey=submitit).
        prefix = f"{self.name}_"
        unset = {k.removeprefix(prefix): None for k, v in params.items() if v is None and k.startswith(prefix)}
        if unset:
            executor._executor.update_parameters(**unset)
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

    def file_system_lag_s(self, spec: LaunchSpec) -> float:
        """How long a file a finished job wrote may take to show here: none on this machine's own disk."""
        return 0.0

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """How a job without results ended, and whether it ended under the work (which then runs again: `again`)
        rather than by it (the stage fails)."""
        return "FAILED", False

    def again(self, job: submitit.Job, name: str) -> submitit.Job | None:
        """The job that runs the work again after `job` ended under it, or None where that is a new job: the retry
        loop (launch.py) submits it and records it (job_record.py), which no launcher does itself."""
        return None


def failed(job: submitit.Job, spec: LaunchSpec, name: str, state: str, detail: str) -> JobFailed:
    where = f"{name}: {spec.launcher} job {job.job_id} ended {state}; read {job.paths.stderr}"
    return JobFailed(f"{where}\n{_stderr_tail(job)}\n{detail}")


def _stderr_tail(job: submitit.Job) -> str:
    tails = []
    for rank in range(job.num_tasks):
        path = job.task(rank).paths.stderr
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
            tails.append(f"--- {path} (last {len(lines)} lines) ---\n" + "\n".join(lines))
    return "\n".join(tails)


def ended_well(job: submitit.Job, rank: int) -> bool:
    """A rank that left its result behind, and not an error: submitit pickles ("success", result)."""
    path = job.task(rank).paths.result_pickle
    return path.exists() and pickle_load(path)[0] == "success"


def pid_alive(pid: int) -> bool:
    """A process of this host that runs (a zombie has ended): what a local job or a step's srun is known by."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
