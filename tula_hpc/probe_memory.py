"""Stage `probe_memory`: the largest per-device batch, from the memory model of a training step
(memory_model.py) fitted to probes (memory_probes.py).

The stage. Every probe and trial runs in a fresh process (one probe's allocator and lazily built kernels
must not leak into the next) under the device budget (budget.py). The model proposes the largest batch;
at most MAX_VERIFICATION_TRIALS trials confirm or correct it, each using what the one before measured.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from . import launch
from .budget import (
    GB,
    budget_bytes,
    budget_source,
    usable_bytes,
)
from .files import write_json
from .memory_model import (
    DECIDING_FIGURE,
    PARTS,
    PEAK,
    StepMemoryModel,
    collective_buffer_bytes,
    composition,
    ddp_bucket_bytes,
    fit_probes,
    measured,
    next_probe,
    next_trial,
    room_for_steps,
    settle,
)
from .memory_probes import probe_device, run_in_fresh_process
from .stage import StageError, stage_main

if TYPE_CHECKING:
    from .job import Job

PROBES_AT_ONCE = 2  # on the CPU: the rule's threads (workflow/rules/memory.smk)


def run_probes(job: Job, cap: int, budget: int) -> list[dict]:
    """The configured probes (a fresh process each; two at once on two cores, one at a time on a GPU), then
    those `next_probe` adds, in the order they ran."""
    # On the CPU two probes share the cores; a GPU holds one probe at a time, each allowed the whole budget.
    at_once = 1 if job.resources.gpus_per_node > 0 else min(PROBES_AT_ONCE, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        probes = list(
            pool.map(lambda b: run_in_fresh_process("measure", job=job, batch=b), job.resources.memory_probe_batches)
        )
    while not any(p["outcome"] == "budget_too_small" for p in probes) and (batch := next_probe(probes, cap, budget)):
        probes.append(run_in_fresh_process("measure", job=job, batch=batch))
    return probes


def probe_worker(job: Job) -> dict:
    """Probes, then the verification trials at the usable budget (never above a batch that failed)."""
    from .data import load_splits

    splits, device = load_splits(job.data, job.train.seed), probe_device(job)
    cap, budget, ring = len(splits.train), budget_bytes(job, device), collective_buffer_bytes(job, device)
    probes = run_probes(job, cap, budget)
    trials: list[dict] = []
    ran, usable = measured(probes), room_for_steps(job, budget, probes) - ring  # a one-rank trial has no ring
    if len(ran) >= 2:
        model, buckets = fit_probes(ran), ddp_bucket_bytes(job, ran)
        failed = [p["batch"] - 1 for p in probes if p["outcome"] == "out_of_memory"]
        while (batch := next_trial(model, usable - buckets, trials, min([cap, *failed]))) is not None:
            trial = run_in_fresh_process("trial", job=job, batch=batch, budget=usable, ddp=buckets > 0)
            trials.append(
                {**trial, **{k: trial[k] - buckets for k in (*PEAK.values(), "failed_at_bytes") if trial.get(k)}}
            )
    return {
        "probes": probes,
        "trials": trials,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget,
        "dataset": {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)},
    }


def fit_summary(model: StepMemoryModel, largest: int, ran: list[dict], unprobed: int) -> dict:
    """A figure's model near the largest batch, as memory.json reports it, with the `unprobed` fixed bytes that
    only a multi-device run holds (DDP's buckets, NCCL's ring)."""
    intercept, slope = model.line_at(largest)
    return {
        "intercept_bytes": intercept + unprobed,
        "slope_bytes_per_sample": slope,
        "peak_part": PARTS[model.part_at(largest)],
        "departure": model.departure_,
        "growing_share_at_largest_probe": model.growing_share(ran[-1]["batch"]),
    }


def _refuse(job: Job, budget: int, message: str) -> StageError:
    res = job.resources
    return StageError(
        f"job '{job.name}': field 'resources.device_memory_gb': {res.device_memory_gb} "
        f"({budget:,} bytes, {usable_bytes(job, budget):,} after {res.memory_headroom:.0%} headroom) "
        f"{message}"
    )


def summarise(job: Job, measured_steps: dict) -> dict:
    """memory.json from the probes and trials; a budget that cannot hold batch 1 is a clear error."""
    probes, budget = measured_steps["probes"], measured_steps["device_memory_bytes"]
    for probe in probes:
        if probe["outcome"] == "budget_too_small":
            raise StageError(probe["error"])
    ran = measured(probes)
    if len(ran) < 2:
        smallest = min((p for p in probes if p["outcome"] != "measured"), key=lambda p: p["batch"])
        raise _refuse(
            job,
            budget,
            f"runs out of memory in a training step of {job.model.name} at batch {smallest['batch']}"
            + (f": it needs more than {smallest['failed_at_bytes']:,} bytes" if smallest.get("failed_at_bytes") else "")
            + "; the memory model needs steps at two batches",
        )
    model, buckets, ring = fit_probes(ran), ddp_bucket_bytes(job, ran), measured_steps["collective_buffer_bytes"]
    usable = room_for_steps(job, budget, probes)
    available = usable - buckets - ring
    proposed = model.max_batch(available)
    if proposed < 1:
        needed = int(model.predict([1])[0] + buckets + ring)
        raise _refuse(
            job,
            budget,
            f"cannot hold a training step of {job.model.name} even at batch 1: it needs "
            f"{needed:,} bytes ({needed / GB:.3f} GB)",
        )
    fitting_probes = [p["batch"] for p in ran if p[PEAK[DECIDING_FIGURE]] <= available]
    largest, verified = settle(measured_steps["trials"], max(fitting_probes, default=1))
    allocated = fit_probes(ran, "allocated")
    return {
        "job": job.name,
        "model": "phase_lines",
        "probes": probes,
        "decided_by": DECIDING_FIGURE,
        "fit": fit_summary(model, largest, ran, buckets + ring),
        "fit_allocated": fit_summary(allocated, largest, ran, buckets + ring),
        "composition": composition(allocated, ran[-1], buckets, ring),
        "param_bytes": ran[0]["param_bytes"],
        "ddp_bucket_bytes": buckets,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget,
        "device_memory_source": budget_source(job),
        "headroom": job.resources.memory_headroom,
        "usable_bytes": usable,
        "outside_allocator_bytes": max((p.get("outside_allocator_bytes", 0) for p in ran), default=0),
        "collective_library_bytes": max((p.get("collective_library_bytes", 0) for p in ran), default=0),
        "predicted_max_batch": proposed,
        "predicted_peak_bytes": int(model.predict([largest])[0] + buckets + ring),
        "verification": measured_steps["trials"],
        "verified": verified,
        "max_batch_per_device": largest,
        "limited_by": "training set" if proposed > largest == measured_steps["dataset"]["train"] else "memory",
        "dataset": measured_steps["dataset"],
    }


def probe_memory(job: Job, out: Path, work_dir: Path) -> dict:
    spec = launch.LaunchSpec.for_job(job, nodes=1, one_device=True, measuring_in=work_dir)
    measured = launch.run(
        probe_worker, dict(job=job), spec, Path(work_dir) / "probe_memory", name=f"{job.name}-probe-memory"
    )
    result = summarise(job, measured)
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/memory.json")

    return stage_main("probe-memory", add_args, lambda job, args: probe_memory(job, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
