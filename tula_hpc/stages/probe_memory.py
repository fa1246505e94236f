"""Stage `probe_memory`: the largest per-device batch, from the memory model of a training step
(memory/model.py) fitted to probes (profiling/memory_probes.py).

The stage. Probes and trials run one after another in the stage's worker, each run's memory given back before the
next (resources.memory_probes_in: fresh_processes gives each a new process instead), under the device budget
(memory/device_budget.py). The allocated-peak model proposes the largest batch. On CUDA the trials then bracket the
card's real limit under the budget (memory/model.py's next_bracket_trial) and the job's headroom comes off the limit
they found (cuda_choice); on the CPU, whose budget allocator is exact, at most MAX_VERIFICATION_TRIALS trials at
the usable budget confirm or correct the model, each using what the one before measured.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.cluster import launch
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.errors import StageError
from tula_hpc.memory.device_budget import (
    GB,
    budget_bytes,
    budget_source,
    usable_bytes,
)
from tula_hpc.memory.model import (
    BRACKET,
    DECIDING_FIGURE,
    StepMemoryModel,
    collective_buffer_bytes,
    composition,
    cuda_choice,
    ddp_bucket_bytes,
    fit_probes,
    measured,
    next_bracket_trial,
    next_probe,
    next_trial,
    room_for_steps,
    settle,
)
from tula_hpc.memory.step_parts import PARTS, PEAK
from tula_hpc.profiling.memory_probes import probe_device, run_in_fresh_process, run_in_this_process
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

PROBES_AT_ONCE = 2  # on the CPU: the rule's threads (workflow/rules/memory.smk)


def runner(job: Job):
    """How a probe or trial is run (resources.memory_probes_in): here, one after another, or each in a fresh process;
    auto: here on a GPU, fresh processes on the CPU."""
    where = job.resources.memory_probes_in
    if where == "auto":
        where = "one_process" if job.resources.gpus_per_node > 0 else "fresh_processes"
    return run_in_this_process if where == "one_process" else run_in_fresh_process


def run_probes(job: Job, cap: int, budget: int) -> list[dict]:
    """The configured probes, then those `next_probe` adds, in the order they ran. Fresh processes on the CPU run
    two at once on two cores; a GPU holds one probe at a time, each allowed the whole budget."""
    run = runner(job)
    fresh_on_cpu = run is run_in_fresh_process and job.resources.gpus_per_node == 0
    at_once = min(PROBES_AT_ONCE, len(os.sched_getaffinity(0))) if fresh_on_cpu else 1
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        probes = list(pool.map(lambda b: run("measure", job=job, batch=b), job.resources.memory_probe_batches))
    while not any(p["outcome"] == "budget_too_small" for p in probes) and (batch := next_probe(probes, cap, budget)):
        probes.append(run("measure", job=job, batch=batch))
    return probes


def run_trials(job: Job, model: StepMemoryModel, device, budget: int, room: int, buckets: int, cap: int) -> list[dict]:
    """The trials the model's proposal is checked by, their peaks less DDP's buckets (which a trial holds by
    wrapping its model in DDP) so that they read as the one-rank steps the model describes.

    On CUDA they run under the budget training runs under (`budget`, no headroom) and bracket the limit; on the
    CPU under the usable budget (`room`), confirming or correcting the model."""
    run, trials = runner(job), []
    choose, limit = (next_bracket_trial, budget) if device.type == "cuda" else (next_trial, room)
    while (batch := choose(model, room - buckets, trials, cap)) is not None:
        trial = run("trial", job=job, batch=batch, budget=limit, ddp=buckets > 0)
        trials.append({**trial, **{k: trial[k] - buckets for k in (*PEAK.values(), "failed_at_bytes") if trial.get(k)}})
    return trials


def probe_worker(job: Job) -> dict:
    """Probes, then the trials (never above a batch that failed)."""
    from tula_hpc.training.datasets import load_splits
    from tula_hpc.training.models import index_cap

    splits, device = load_splits(job.data, job.train.seed), probe_device(job)
    cap, budget, ring = len(splits.train), budget_bytes(job, device), collective_buffer_bytes(job, device)
    probes = run_probes(job, cap, budget)
    trials: list[dict] = []
    ran = measured(probes)
    if len(ran) >= 2:
        # The CPU's trials run at the usable budget, CUDA's under the whole one; a one-rank trial has no ring.
        room = room_for_steps(job, budget, probes, headroom=device.type != "cuda") - ring
        failed = [p["batch"] - 1 for p in probes if p["outcome"] == "out_of_memory"]
        model, buckets = fit_probes(ran), ddp_bucket_bytes(job, ran)
        trials = run_trials(job, model, device, budget - ring, room, buckets, min([cap, *failed]))
    return {
        "probes": probes,
        "trials": trials,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget,
        "device": device.type,
        "index_cap": index_cap(
            job.model.name, splits.num_classes, splits.in_channels, job.data.image_size, job.model.kwargs
        ),
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
    trials, train_set = measured_steps["trials"], measured_steps["dataset"]["train"]
    largest, verified = settle(trials, max(fitting_probes, default=1))
    limit = None
    if measured_steps.get("device") == "cuda":
        room = room_for_steps(job, budget, probes, headroom=False) - buckets - ring
        limit = cuda_limit(job, model, trials, room, budget, train_set)
        if limit["chosen"]:
            largest, verified = limit["chosen"], True
    memory_limited = limit["limited_by_memory"] if limit else not (proposed > largest == train_set)
    return {
        "job": job.name,
        "model": "phase_lines",
        "probes": probes,
        "decided_by": DECIDING_FIGURE,
        "fit": fit_summary(model, largest, ran, buckets + ring),
        "fit_reserved": fit_summary(fit_probes(ran, "reserved"), largest, ran, buckets + ring),
        "composition": composition(model, ran[-1], buckets, ring),
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
        "verification": trials,
        "verified": verified,
        "limit": limit,
        "max_batch_per_device": largest,
        # Beyond it one tensor holds 2^31 elements or more and CUDA kernels split the batch or index in 64 bits:
        # marked, not capped (on the H200 resnet18 and resnet50 ran above it), since no probe's batch shows it.
        "index_cap": measured_steps.get("index_cap"),
        "beyond_index_cap": largest > measured_steps.get("index_cap", largest),
        "limited_by": "memory" if memory_limited else "training set",
        "dataset": measured_steps["dataset"],
    }


def cuda_limit(job: Job, model: StepMemoryModel, trials: list[dict], room: int, budget: int, train_set: int) -> dict:
    """memory_model.cuda_choice with what memory.json says of it: the allocator's settings and how the allowance
    was measured."""
    choice = cuda_choice(model, trials, room, budget, job.resources.memory_headroom, train_set)
    return {
        **choice,
        "cuda_alloc_conf": job.resources.cuda_alloc_conf,
        "allowance_measured_as": (
            "the room the steps may fill less the allocated-peak model at the largest batch a trial ran under the "
            f"budget, the next one up having run out of memory (bracketed within {BRACKET:.0%})"
            if choice["allowance_bytes"] is not None
            else "not measured: the training set, not memory, limited the trials"
        ),
        "retries_and_ooms": [
            {"batch": t["batch"], "outcome": t["outcome"], **t.get("allocator_events", {})} for t in trials
        ],
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
