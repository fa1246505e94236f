"""The local launcher (`LocalLauncher`, for a laptop and the tests) and its bad-exit watchdog, which ends the other
ranks once one has failed, as `srun --kill-on-bad-exit` does on Slurm."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import psutil
import submitit

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import Launcher, ended_well, failed, pid_alive

BAD_EXIT_POLL_S = 0.1


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
        if not pid_alive(pid):
            return None
        while pid_alive(pid):
            time.sleep(0.5)
        return submitit.local.local.LocalJob(
            folder=Path(record["folder"]), job_id=record["job_id"], tasks=range(record["tasks"])
        )

    def wait(self, job: submitit.Job, spec: LaunchSpec, name: str) -> None:
        end_at_first_bad_exit(job)
        missing = [rank for rank in range(job.num_tasks) if not job.task(rank).paths.result_pickle.exists()]
        if missing:  # known at once on this disk: no need for submitit's wait for results on a slow file system
            raise failed(job, spec, name, "FAILED", f"no result from rank(s) {missing}")


def end_at_first_bad_exit(job: submitit.Job) -> None:
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
        if alive and ended and ended > sum(ended_well(job, rank) for rank in range(job.num_tasks)):
            for pid in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()
        time.sleep(BAD_EXIT_POLL_S)
