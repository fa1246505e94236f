"""The measuring phase's shared allocation (resources.allocation: shared): one holder job, asked for once and kept
in allocation.json, whose job steps the memory probes and the profiles run as (launchers/shared_allocation.py),
so that the queue is waited in once; given back once every measurement is written."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.partition import partition_limits, sbatch_args
from tula_hpc.cluster.pending import PendingForever, PendingWatch
from tula_hpc.cluster.shared_files import exclusive_lock
from tula_hpc.cluster.slurm_states import (
    ACTIVE_SLURM_STATES,
    backoff,
    being_preempted,
    cancel,
    settled_state,
    slurm_state,
)
from tula_hpc.core.atomic_files import StageInputError, read_json, write_json

ALLOCATION_POLL_S = 2


class AllocationFailed(RuntimeError):
    """Slurm refused the measuring allocation, or it ended before it started; the message says which."""


def holder_command(spec: LaunchSpec, name: str, nodes: int) -> list[str]:
    """The sbatch of the allocation itself: `nodes` of the job's nodes (resources.gpus_per_node GPUs each, whatever
    the first measurement asks for) for resources.time_min (at least a step's limit), a shell that only waits (its
    steps do the work), released by `release_allocation` or at its time limit."""
    allocation = spec.allocation
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}"]
    cmd += [f"--ntasks-per-node={max(1, allocation.gpus_per_node)}"]
    cmd.append(f"--time={max(allocation.time_min, spec.time_min)}")
    cmd += sbatch_args(spec.slurm, spec.cpus_per_task, spec.mem_gb, allocation.gpus_per_node)
    return cmd + [f"--output={allocation.folder}/holder-%j.out", "--wrap", "exec sleep infinity"]


def hold_allocation(spec: LaunchSpec) -> str:
    """The id of the measuring phase's allocation, running: the one recorded if it is still active and large
    enough, else a new one (a record left by one that ended, by time limit, preemption or a lost node, is
    replaced); waits while it is queued. One stage at a time decides (a lock file beside the record)."""
    folder = Path(spec.allocation.folder)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / "allocation.lock"):
        job_id = _recorded_or_new(spec, folder)
    pending, pauses = PendingWatch(job_id, "the measuring allocation"), backoff()
    while (state := slurm_state(job_id)) != "RUNNING":
        if state not in ACTIVE_SLURM_STATES:
            raise AllocationFailed(f"the measuring allocation {job_id} ended {state} before it started")
        try:
            if state == "PENDING" and pending.requeue_held():  # after a lost node (see SlurmLauncher.again)
                cancel(job_id)
                return hold_allocation(spec)
        except PendingForever as err:
            raise AllocationFailed(str(err)) from None
        time.sleep(next(pauses))
    return job_id


def _recorded_or_new(spec: LaunchSpec, folder: Path) -> str:
    """The recorded allocation while Slurm holds it and it is large enough (a smaller one is cancelled), else a
    new one, recorded. slurm_state waits out a controller away: an allocation is never given up on missing word."""
    record_path = folder / "allocation.json"
    recorded = read_json(record_path) if record_path.exists() else None
    if recorded and settled_state(recorded["job_id"]) in ACTIVE_SLURM_STATES:
        if being_preempted(recorded["job_id"]):
            _wait_for_its_end(recorded["job_id"])  # PREEMPTED after its grace time, as the steps in it must see it
        elif recorded["nodes"] >= spec.nodes:
            return recorded["job_id"]
        else:
            cancel(recorded["job_id"])
    name = f"{folder.parent.name}-allocation"
    limits = partition_limits(spec.slurm.partition)
    nodes = max(spec.nodes, min(spec.allocation.nodes, limits.nodes, limits.max_nodes or limits.nodes))
    done = subprocess.run(holder_command(spec, name, nodes), capture_output=True, text=True)
    if done.returncode != 0:
        raise AllocationFailed(f"{name}: sbatch refused the allocation: {done.stderr.strip()}")
    recorded = {"job_id": done.stdout.strip().split(";")[0], "nodes": nodes, "asked": time.time()}
    write_json(record_path, recorded)
    print(f"[tula-hpc] asked Slurm for the measuring allocation {recorded['job_id']} ({nodes} nodes)", flush=True)
    return recorded["job_id"]


def _wait_for_its_end(job_id: str) -> None:
    """Until an allocation Slurm chose for preemption has ended (its GraceTime): cancelled instead, it would end
    CANCELLED, which the stages whose steps ran in it take for a person's cancel, and fail."""
    print(f"[tula-hpc] the measuring allocation {job_id} is being preempted: a new one once it ends", flush=True)
    pauses = backoff(most_s=10)
    while slurm_state(job_id) in ACTIVE_SLURM_STATES:
        time.sleep(next(pauses))


def release_allocation(work_dir: Path) -> bool:
    """Give the measuring phase's allocation back (fit_model, once every measurement is written, and the workflow
    on its way out of a failure); True if there was one."""
    record_path = Path(work_dir) / "allocation" / "allocation.json"
    if not record_path.exists():
        return False
    try:
        held = read_json(record_path)
    except StageInputError:  # given back meanwhile by a stage that finished beside this one
        return False
    cancel(held["job_id"])
    record_path.unlink(missing_ok=True)
    return True
