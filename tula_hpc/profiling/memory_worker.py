"""The probe_memory stage's worker, on the job's node: the configured probes and those the memory model asks for,
then the trials that check its proposal, under the device budget (memory/device_budget.py). Probes and trials run one
after another here, each run's memory given back before the next (resources.memory_probes_in: fresh_processes gives
each a new process instead, memory_probes.py). The allocated-peak model proposes the largest batch. On CUDA the
trials then bracket the card's real limit under the budget (memory/model.py's next_bracket_trial); on the CPU, whose
budget allocator is exact, at most MAX_VERIFICATION_TRIALS trials at the usable budget confirm or correct the model,
each using what the one before measured. The stage launches it by name and summarises what it returns
(memory_summary.py) where Snakemake runs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tula_hpc.memory.device_budget import budget_bytes
from tula_hpc.memory.model import (
    StepMemoryModel,
    collective_buffer_bytes,
    ddp_bucket_bytes,
    fit_probes,
    measured,
    next_bracket_trial,
    next_probe,
    next_trial,
    room_for_steps,
)
from tula_hpc.memory.step_parts import PEAK
from tula_hpc.profiling.memory_probes import probe_device, run_in_fresh_process, run_in_this_process

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
    from tula_hpc.training.tasks import job_task

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
        "index_cap": index_cap(job.model.name, splits.shape, job.model.kwargs, job_task(job)),
        "dataset": {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)},
    }
