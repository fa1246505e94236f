"""A profile job, submitted from where Snakemake runs: one candidate's timed steps (step_timing.py's worker, launched
by name so that torch is imported on the nodes, not here), its record written atomically with what ran it; the plan's
profiles and those adaptive search and the choice's confirmation add (the profile and adapt stages) run the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.cluster import launch
from tula_hpc.cluster.allocation import release_allocation
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.dependencies import fingerprint
from tula_hpc.core.errors import StageError
from tula_hpc.core.records import sequence_fields
from tula_hpc.core.run_layout import profile_name, ranks_per_host

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

PROFILE_WORKER = launch.Worker("tula_hpc.profiling.step_timing", "profile_worker")


def _out_of_memory_error(
    job: Job, nodes: int, batch: int, world_size: int, record: dict, max_per_device: int
) -> StageError:
    """A profile that ran out of memory: the memory model (memory.json, via the plan) sized the batch wrong."""
    return StageError(
        f"job '{job.name}': the profile at nodes={nodes}, global batch {batch} ({batch // world_size} per device) "
        f"ran out of memory on rank {record['rank']}, though the memory model (memory.json) allows up to "
        f"{max_per_device} per device; rerun probe_memory (delete results/{job.name}/memory.json) if the "
        f"device, the model or the job's settings changed, raise resources.memory_headroom, or lower "
        f"search.batch.max. Error: {record['error']}"
    )


def profile_one(job: Job, candidate: dict, out: Path, work_dir: Path, max_per_device: int) -> dict:
    """Run one profile job at a plan candidate's (nodes, GPUs per node, batch) and write its file atomically;
    `max_per_device` is memory.json's largest batch per device, for the error when the profile runs out of memory."""
    nodes, batch = candidate["nodes"], candidate["batch"]
    spec = launch.LaunchSpec.for_job(
        job, nodes=nodes, gpus_per_node=candidate.get("gpus_per_node"), measuring_in=work_dir
    )
    started = time.perf_counter()
    name = profile_name(candidate, job)
    result, out_of_memory = launch.run_or_out_of_memory(
        PROFILE_WORKER,
        dict(job=job, global_batch=batch, checkpoint_dir=str(Path(work_dir) / "profile" / name)),
        spec,
        Path(work_dir) / "profile" / name,
        name=f"{job.name}-profile-{name.replace('_', '-')}",
    )
    if out_of_memory is not None:
        raise _out_of_memory_error(job, nodes, batch, spec.world_size, out_of_memory, max_per_device)
    result.update(
        nodes=nodes,
        gpus_per_node=spec.gpus_per_node,
        launcher=spec.launcher,
        ranks_per_host=ranks_per_host(spec.launcher, nodes, spec.tasks_per_node),
        job_wall_s=time.perf_counter() - started,
        fingerprint=fingerprint(job, "profile"),
        **sequence_fields(job, result.get("samples_per_s")),
    )
    write_json(out, result)
    return result


def give_back_allocation(work_dir: Path, stage: str) -> None:
    """The last measurement is written: the measuring allocation goes back now, not when the next stage starts."""
    if release_allocation(Path(work_dir)):
        print(f"[{stage}] the last measurement is written: gave the measuring allocation back", flush=True)
