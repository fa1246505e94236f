"""The Slurm launcher: one sbatch job of N nodes per stage run, through submitit's Slurm executor, found again by
its id (or, where its driver died before it heard the id, by name and folder) and waited for again when Slurm
requeued it itself."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import submitit

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import Launcher
from tula_hpc.cluster.slurm_options import resource_options, site_options
from tula_hpc.cluster.slurm_states import ACTIVE_SLURM_STATES, cancel, held, settled_state, slurm_state, submitted_from

REQUEUED_POLL_S = 5.0  # how often a job Slurm requeued is looked at until it has run again


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

    def end_state(self, job: submitit.Job) -> tuple[str, bool]:
        """A job still active has been requeued by Slurm itself (a node it ran on failed, JobRequeue): it runs
        again. submitit's own requeues (time limit, preemption) happen inside the job and never end it."""
        state = settled_state(str(job.job_id))
        return ("REQUEUED", True) if state in ACTIVE_SLURM_STATES else (state, False)

    def again(self, job: submitit.Job, name: str) -> submitit.Job | None:
        """The same job, once it has run again (submitit's watcher took its first end for its last: sacct said
        NODE_FAIL). A requeued job that starts while its earlier run's step still ends on a node that came back
        fails to launch and is requeued held, to wait for an admin (the local cluster showed it): a held one is
        cancelled and the work goes in a new job (None; training resumes from its checkpoint)."""
        job_id = str(job.job_id)
        while (state := settled_state(job_id)) in ACTIVE_SLURM_STATES:
            if state == "PENDING" and held(job_id):
                print(f"[tula-hpc] slurm job {job_id} is held: cancelled, and {name} goes in a new job", flush=True)
                cancel(job_id)
                return None
            time.sleep(REQUEUED_POLL_S)
        return job
