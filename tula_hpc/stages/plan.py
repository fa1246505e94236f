"""Stage `plan`: the candidate grid of (nodes N, GPUs per node g, global batch B) and which candidates to profile
first.

Candidates: N a power of two times the minimum, up to the maximum; g likewise, and its maximum (the node's GPUs
unless search.gpus_per_node narrows them; 0 on CPU jobs, one rank per node); B a power of two times the minimum
batch, up to the maximum (or the ranks x the largest per-device batch from memory.json when `auto`), never above
the training set; B must split evenly over the N x g ranks and fit in a device.

On Slurm, the candidates the job's partition cannot run (more nodes than its MaxNodes or its nodes, more GPUs per
node than its nodes hold) are left out, each with the limit it breaks in plan.json's `partition`.

Which of them to profile before the model is fitted is the search mode's (performance/search_modes.py).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from tula_hpc.cluster.partition import partition_limits, within_partition
from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.errors import StageError
from tula_hpc.core.job import Job, SearchSettings
from tula_hpc.core.run_layout import candidate_devices, doublings
from tula_hpc.performance import search_modes as search
from tula_hpc.stages.runner import stage_main


def gpu_counts(search: SearchSettings) -> list[int]:
    """GPUs per node the grid holds: doublings of search.gpus_per_node's min, and its max; 0 alone on a CPU job."""
    shape = search.gpus_per_node
    if shape.max == 0:
        return [0]
    counts = doublings(shape.min, shape.max)
    return counts if counts[-1] == shape.max else counts + [shape.max]


def candidate_grid(search: SearchSettings, max_batch_per_device: int, train_samples: int) -> list[dict]:
    grid = []
    for nodes in doublings(search.nodes.min, search.nodes.max):
        for gpus in gpu_counts(search):
            ranks = nodes * max(1, gpus)
            memory_cap = ranks * max_batch_per_device
            batch_max = memory_cap if search.batch.max == "auto" else min(search.batch.max, memory_cap)
            for batch in doublings(search.batch.min, min(batch_max, train_samples)):
                if batch % ranks == 0:
                    grid.append(
                        {"nodes": nodes, "gpus_per_node": gpus, "batch": batch, "per_device_batch": batch // ranks}
                    )
    return grid


def _within_the_partition(job: Job, grid: list[dict]) -> tuple[list[dict], dict | None]:
    """On Slurm, the candidates the job's partition can run (cluster.PartitionLimits) and what it allows; a grid
    it cannot run at all is an error naming the limits."""
    if job.launcher != "slurm" or not grid:
        return grid, None
    limits = partition_limits(job.resources.slurm.partition)
    kept, excluded = within_partition(grid, limits)
    if not kept:
        raise StageError(
            f"job '{job.name}': fields 'search.nodes'/'search.gpus_per_node': partition {limits.partition} can run "
            f"none of the candidates: {excluded[0]['breaks'][0]} (every candidate breaks a limit: "
            f"{'; '.join(sorted({b for c in excluded for b in c['breaks']}))})"
        )
    return kept, {**asdict(limits), "excluded": excluded}


def plan(job: Job, memory_path: Path, out: Path) -> dict:
    memory = read_json(memory_path)
    grid = candidate_grid(job.search, memory["max_batch_per_device"], memory["dataset"]["train"])
    grid, partition = _within_the_partition(job, grid)
    if not grid:
        raise StageError(
            f"job '{job.name}': fields 'search.nodes'/'search.gpus_per_node'/'search.batch': no (nodes, batch) "
            f"candidate fits: batches must be multiples of nodes x GPUs per node, at most "
            f"{memory['max_batch_per_device']} per device (memory.json) and at most "
            f"{memory['dataset']['train']} (the training set)"
        )
    mode = job.search.mode
    # Devices per node of a grid with one such value (a grid of several: partial_set reads each candidate's).
    devices = candidate_devices(grid[0], job)
    result = {
        "job": job.name,
        "mode": mode,
        "candidates": grid,
        "profile": search.planned(mode, grid, devices, job.launcher, job.search.partial_second_batch),
        "max_batch_per_device": memory["max_batch_per_device"],
        "dataset": memory["dataset"],
        "partition": partition,
    }
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--memory", required=True, type=Path, help="memory.json from probe_memory")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/plan.json")

    return stage_main("plan", add_args, lambda job, args: plan(job, args.memory, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
