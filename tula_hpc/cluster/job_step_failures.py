"""How a rank that fails mid-step ends its job step and tells the stage why: a record per rank in a folder the
stage names (`failure_dir`), read back by the stage, which waits where Snakemake runs and imports no torch."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from tula_hpc.cluster.devices import is_out_of_memory
from tula_hpc.cluster.shared_files import appeared
from tula_hpc.core.atomic_files import read_json, write_json

FAILED_RANK_EXIT = 3  # a rank ended the job step on purpose (see end_job_step)


def end_job_step(folder: str | Path, rank: int, note: dict) -> NoReturn:
    """Record why this rank stops, then end the whole job step at once, under any backend.

    The peers of a rank that fails mid-step (out of memory in backward) wait in collectives it will never
    join: gloo's fail when its connections close, NCCL's hang until a watchdog fires. So no rank waits to
    learn of it: this one exits non-zero, and `srun --kill-on-bad-exit` (Slurm) or the local launcher ends
    every other rank. The stage then reads the record (`failure_records`) and decides what comes next.
    """
    write_json(Path(folder) / f"rank{rank}.json", {**note, "rank": rank, "recorded_at": time.time()})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_RANK_EXIT)


def failure_records(folder: str | Path) -> list[dict]:
    """What the ranks that ended a job step recorded, by rank."""
    return [read_json(path) for path in sorted(Path(folder).glob("rank*.json"))]


@contextlib.contextmanager
def out_of_memory_ends_job_step(failure_dir: str | None, in_effect: Callable[[], dict] | None = None):
    """A rank that runs out of memory inside records it in `failure_dir` (with `in_effect()`'s fields: what it ran
    at) and ends the job step (`end_job_step`); without `failure_dir` (called in-process) the error is raised."""
    try:
        yield
    except Exception as err:
        if failure_dir and is_out_of_memory(err):
            note = {"outcome": "out_of_memory", "error": str(err)[:500], **(in_effect() if in_effect else {})}
            end_job_step(failure_dir, int(os.environ.get("RANK", "0")), note)
        raise


def out_of_memory_record(folder: str | Path, within_s: float = 0) -> dict | None:
    """The record of a rank that ended the job step out of memory, with how long before the stage knew
    (`noticed_after_s`); None if none did (the job failed otherwise). A record written on another node may take
    up to `within_s` to show on a shared file system (resources.slurm.file_system_lag_s)."""
    appeared(Path(folder), lambda: any(Path(folder).glob("rank*.json")), within_s)
    record = next((r for r in failure_records(folder) if r["outcome"] == "out_of_memory"), None)
    if record is not None:
        record["noticed_after_s"] = round(time.time() - record.pop("recorded_at"), 1)
    return record
