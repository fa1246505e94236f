"""Stage `probe_memory`: the largest per-device batch, from the memory model of a training step
(memory/model.py) fitted to probes.

The stage launches its worker (profiling/memory_worker.py: probes, then the trials that check the model's proposal,
under the device budget) on one device and writes memory.json from what it measured (profiling/memory_summary.py: on
CUDA the card's limit the trials bracketed, less the job's headroom; on the CPU the model confirmed or corrected).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc._legacy_paths import moved_names
from tula_hpc.cluster import launch
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.records import sequence_fields
from tula_hpc.profiling.memory_summary import summarise
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# Launched by name: the stage, which waits for it where Snakemake runs (a login node), imports no torch.
PROBE_WORKER = launch.Worker("tula_hpc.profiling.memory_worker", "probe_worker")
__getattr__ = moved_names(__name__)  # jobs pickled when the worker lived here


def probe_memory(job: Job, out: Path, work_dir: Path) -> dict:
    spec = launch.LaunchSpec.for_job(job, nodes=1, one_device=True, measuring_in=work_dir)
    measured = launch.run(
        PROBE_WORKER, dict(job=job), spec, Path(work_dir) / "probe_memory", name=f"{job.name}-probe-memory"
    )
    result = {**summarise(job, measured), **sequence_fields(job)}
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/memory.json")

    return stage_main("probe-memory", add_args, lambda job, args: probe_memory(job, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
