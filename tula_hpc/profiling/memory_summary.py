"""memory.json from what the probe worker measured (memory_worker.py): the memory model fitted to the probes, the
largest batch the trials settled on (on CUDA the card's limit they bracketed, less the job's headroom), and a budget
that cannot hold batch 1 refused with the job and the bytes named. Runs in the stage, where Snakemake runs: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tula_hpc.core.errors import StageError
from tula_hpc.memory.device_budget import GB, budget_source, usable_bytes
from tula_hpc.memory.model import (
    BRACKET,
    DECIDING_FIGURE,
    StepMemoryModel,
    composition,
    cuda_choice,
    ddp_bucket_bytes,
    fit_probes,
    measured,
    room_for_steps,
    settle,
)
from tula_hpc.memory.step_parts import PARTS, PEAK

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


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


def _probes_that_ran(job: Job, probes: list[dict], budget: int) -> list[dict]:
    """The probes that measured a step; fewer than two, or a budget too small for the model, is a clear error."""
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
    return ran


def summarise(job: Job, measured_steps: dict) -> dict:
    """memory.json from the probes and trials; a budget that cannot hold batch 1 is a clear error."""
    probes, budget = measured_steps["probes"], measured_steps["device_memory_bytes"]
    ran = _probes_that_ran(job, probes, budget)
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
