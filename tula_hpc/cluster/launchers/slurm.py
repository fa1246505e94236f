"""The Slurm launcher: one sbatch job of N nodes per stage run, through submitit's Slurm executor, found again by
its id (or, where its driver died before it heard the id, by name and folder), watched in Slurm until its state is
final, and run again in a new job where it ended under the work (preempted, its time limit, a lost node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, pickle_load

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import JobFailed, Launcher
from tula_hpc.cluster.pending import REQUEUE_HELD, PendingForever, PendingWatch, pending_reason
from tula_hpc.cluster.shared_files import FILE_SYSTEM_LAG_S, appeared
from tula_hpc.cluster.slurm_options import resource_options, site_options
from tula_hpc.cluster.slurm_states import (
    ACTIVE_SLURM_STATES,
    ENDED_UNDER_THE_WORK,
    backoff,
    being_preempted,
    cancel,
    settled_state,
    slurm_state,
    submitted_from,
)

JOB_POLL_MAX_S = 30.0  # a job is looked at every 2 s at first, then less often, at least this often


class SlurmLauncher(Launcher):
    """One sbatch job of N nodes per stage run."""

    name = "slurm"

    def shape(self, spec: LaunchSpec) -> dict[str, Any]:
        slurm = spec.slurm
        options = {**resource_options(slurm, spec.gpus_per_node, spec.mem_gb), **site_options(slurm)}
        return dict(
            nodes=spec.nodes,
            tasks_per_node=spec.tasks_per_node,
            # Every option from the one home (slurm_options.py), under submitit's own names, so that each replaces
            # submitit's rather than writing a second #SBATCH line beside it.
            slurm_additional_parameters={name.replace("-", "_"): value for name, value in options.items()},
            slurm_wckey=None,  # unsets submitit's --wckey=submitit; resources.slurm.wckey is among the options
            slurm_setup=list(slurm.setup) if slurm.setup else None,
            # One dead rank ends the whole step at once instead of leaving the others in a collective. srun inherits
            # no --cpus-per-task from the job in Slurm 22.05 to 23.02: without it each rank gets one core where
            # cgroups confine them.
            slurm_srun_args=["--kill-on-bad-exit=1", f"--cpus-per-task={spec.cpus_per_task}"],
            # The warning before the time limit must leave time to work: a quarter of short limits, 90 s at most.
            slurm_signal_delay_s=spec.warning_before_limit_s,
        )

    def reattach(self, record: dict) -> submitit.Job | None:
        """The recorded job while active; one whose driver died before it heard the id is found by name and folder."""
        job_id = record["job_id"] or submitted_from(record["name"], record["folder"])
        if job_id is None or slurm_state(job_id) not in ACTIVE_SLURM_STATES:
            return None
        return submitit.SlurmJob(folder=Path(record["folder"]), job_id=job_id, tasks=range(record["tasks"]))

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        """Until Slurm says the job's state is final (squeue, then accounting), or it is held by a failed requeue's
        launch (the retry loop replaces it). submitit's own wait is not used: it takes PREEMPTED for unfinished
        and would wait for ever on a job that PreemptMode=CANCEL ended. Requeued under the same id (submitit at
        the time limit, Slurm after a lost node), it is waited for again; a pending reason is printed as it
        changes, and one no wait clears fails the stage. A completed job's results are waited for on a shared file
        system, up to resources.slurm.file_system_lag_s."""
        job_id, pauses = str(job.job_id), backoff(most_s=JOB_POLL_MAX_S)
        pending = PendingWatch(job_id, name)
        while (state := slurm_state(job_id)) in ACTIVE_SLURM_STATES:
            try:
                if state == "PENDING" and pending.requeue_held():
                    return
            except PendingForever as err:
                raise JobFailed(str(err)) from None
            if self.results_written(job, within_s=next(pauses)):  # looked for between looks at the state (a job
                return  # seen pending may have run since), as submitit's own wait does: its end need not be waited for
        if state == "COMPLETED":
            self.results_written(job, within_s=self.file_system_lag_s(spec))

    def file_system_lag_s(self, spec: LaunchSpec) -> float:
        lag = spec.slurm.file_system_lag_s
        return FILE_SYSTEM_LAG_S if lag is None else lag

    def results_written(self, job: submitit.Job, within_s: float) -> bool:
        """Whether every rank's result file shows within `within_s` (looked for while the job runs, between looks
        at its state, and for resources.slurm.file_system_lag_s once it completed)."""
        paths = [job.task(rank).paths.result_pickle for rank in range(job.num_tasks)]
        return appeared(paths[0].parent, lambda: all(path.exists() for path in paths), within_s)

    def results(self, job: submitit.Job) -> list[Any]:
        """Read from the result files (`wait` waited for them): submitit would wait for the job itself again."""
        outcomes = []
        for rank in range(job.num_tasks):
            path = job.task(rank).paths.result_pickle
            outcome = pickle_load(path) if path.exists() else ("error", f"rank {rank} left no result")
            if outcome[0] != "success":
                raise FailedJobError(str(outcome[1]))
            outcomes.append(outcome[1])
        return outcomes

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """A job still active went back to the queue (held by a failed requeue's launch: `again` replaces it).
        One that ended under the work (ENDED_UNDER_THE_WORK: preempted, its time limit, a lost node) runs again;
        one cancelled by a person, or that failed, fails the stage."""
        state = settled_state(str(job.job_id))
        if state in ACTIVE_SLURM_STATES:
            return "REQUEUED", True
        if state not in ENDED_UNDER_THE_WORK and being_preempted(str(job.job_id)):
            return "PREEMPTED", True  # its ranks saved and left in the grace time: Slurm says FAILED, yet preempted
        return state, state in ENDED_UNDER_THE_WORK

    def again(self, job: submitit.Job, name: str) -> submitit.Job | None:
        """The same job while Slurm still holds it (it runs again under its id), else None: the work goes in a new
        job, and training resumes from its checkpoint. A job held by a failed requeue's launch (a requeued job that
        starts while its earlier run's step still ends on a node that came back; the local cluster showed it)
        waits for an administrator: it is cancelled and replaced. Any other hold is the owner's, and waited on."""
        job_id = str(job.job_id)
        if settled_state(job_id) not in ACTIVE_SLURM_STATES:
            return None
        if pending_reason(job_id) == REQUEUE_HELD:
            print(f"[tula-hpc] slurm job {job_id} is held ({REQUEUE_HELD}): cancelled, {name} goes in a new job")
            cancel(job_id)
            return None
        return job
