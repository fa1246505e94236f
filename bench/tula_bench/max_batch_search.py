"""Benchmark: the largest per-device batch under a device budget, found two ways, counted in trial runs.

A trial run is bench/steady_truth.py under the budget: a fresh process whose device holds at most the
budget (the budget allocator: a real out-of-memory error past it) running steady training steps of the
job at one batch, over three epochs so that AGS runs its update step. For each model:
- lightning: PyTorch Lightning's batch-size finder, mode "binsearch" (init_val 2, doubling until the
  first failure, then bisection between the last success and the first failure; reimplemented here, one
  trial per process rather than Lightning's in-process retries). It ends with a batch that fits next to
  one that does not: that batch is the true largest batch;
- ours: the probe stage as it runs (probes, then at most 2 verification trials), headroom 0. Its answer
  must be within 5 % of the true one and never above it.

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/max_batch_search.py   (writes bench/results/max_batch_search.json)
      .venv/bin/python bench/max_batch_search.py --smoke --out FILE   (under a minute: SMOKE_BUDGET_GB; CI's check
      that the bench runs end to end)
"""

from __future__ import annotations

import time

from tula_bench import steady_truth
from tula_bench.common import bench_job, bench_parser, merged, parse_bench_args, write_result
from tula_hpc.core.job import Job

# (model, image side) -> device budget, GB: each largest batch stays below the digits training set (1258
# samples), beyond which the probe stage does not go (no device of the job ever sees a larger batch).
BUDGET_GB = {
    ("tiny_cnn", 8): 0.06,
    ("resnet18", 8): 0.5,
    ("mobilenet_v3_small", 32): 1.0,
    ("vgg11", 32): 0.5,
}
# --smoke: tiny_cnn under a budget of a few samples, AGS's reference batch and the probes lowered to fit it and the
# probes in this process, so that both searches end in a handful of trial runs (a fresh process each, seconds).
SMOKE_BUDGET_GB = {("tiny_cnn", 8): 0.003}
SMOKE_JOB = {
    "train": {"ags": {"small_batch": 2}},
    "resources": {"memory_probe_batches": [2, 4, 8], "memory_probes_in": "one_process"},
}
LIGHTNING = {"init_val": 2, "max_trials": 25}
TARGETS = {"rel_error": 0.05, "trial_runs": 2}


class Trials:
    """Trial runs of one job under its budget, each a fresh process, with what each answered."""

    def __init__(self, job: Job):
        import torch

        from tula_hpc.memory.device_budget import budget_bytes

        # Bench budgets are figures (BUDGET_GB), the same on any device.
        self.job, self.answers, self.seconds = job, {}, 0.0
        self.budget = budget_bytes(job, torch.device("cpu"))

    def fits(self, batch: int) -> bool:
        started = time.perf_counter()
        self.answers[batch] = steady_truth.measure(self.job, batch, self.budget)["fits"]
        self.seconds += time.perf_counter() - started
        return self.answers[batch]


def lightning_binsearch(trials: Trials) -> int:
    """Lightning's scale_batch_size(mode="binsearch"): double until a failure, then bisect."""
    low, high, size = 1, None, LIGHTNING["init_val"]
    for _ in range(LIGHTNING["max_trials"]):
        if trials.fits(size):
            low = size
            if high is None:
                size *= 2
                continue
        else:
            high = size
        if high - low <= 1:
            break
        size = (high + low) // 2
    return low


def true_largest(trials: Trials, found: int) -> int:
    """`found` when a trial saw it fit and the next batch fail: the boundary, measured on both sides."""
    if not trials.answers.get(found) or trials.answers.get(found + 1) is not False:
        raise RuntimeError(f"the search did not end at a boundary: {sorted(trials.answers.items())}")
    return found


def ours(job: Job) -> dict:
    from tula_hpc.profiling.memory_summary import summarise
    from tula_hpc.profiling.memory_worker import probe_worker

    started = time.perf_counter()
    measured_steps = probe_worker(job)
    result = summarise(job, measured_steps)
    return {
        "batch": result["max_batch_per_device"],
        "predicted_batch": result["predicted_max_batch"],
        "verified": result["verified"],
        "trials": measured_steps["trials"],
        "trial_runs": len(measured_steps["trials"]),
        "probe_batches": [p["batch"] for p in measured_steps["probes"]],
        "seconds": time.perf_counter() - started,
    }


def budget_job(model: str, side: int, smoke: bool = False) -> Job:
    """The model's job under its budget, on one device (no DDP buckets, as in the trials), headroom 0 (a smoke run's:
    SMOKE_BUDGET_GB, with SMOKE_JOB's changes)."""
    budget = (SMOKE_BUDGET_GB if smoke else BUDGET_GB)[model, side]
    sections = {
        "model": {"name": model},
        "data": {"image_size": side},
        "resources": {"device_memory_gb": budget, "memory_headroom": 0.0, "cpus_per_task": 2},
        "search": {"nodes": {"max": 1}},
    }
    return bench_job(as_name=f"bench-{model}-{side}", **(merged(sections, SMOKE_JOB) if smoke else sections))


def bench_model(job: Job) -> dict:
    model, side = job.model.name, job.data.image_size
    found = ours(job)
    trials = Trials(job)
    lightning = lightning_binsearch(trials)
    truth = true_largest(trials, lightning)
    row = {
        "model": model,
        "input": [1, side, side],
        "budget_bytes": trials.budget,
        "strategy": job.train.strategy,
        "true_max_batch": truth,
        "ours": {
            **found,
            "rel_error": (found["batch"] - truth) / truth,
            "above_true": found["batch"] > truth,
        },
        "lightning": {"batch": lightning, "trial_runs": len(trials.answers), "seconds": trials.seconds},
    }
    print(
        f"{model:20s} {side:2d}x{side:<2d} true {truth:5d} | ours {found['batch']:5d} "
        f"({row['ours']['rel_error']:+.1%}) "
        f"in {found['trial_runs']} trial(s) after probes at {found['probe_batches']}, {found['seconds']:.0f} s | "
        f"lightning {lightning:5d} in {len(trials.answers)} trials, {trials.seconds:.0f} s",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, "max_batch_search.json")
    parser.add_argument("--models", nargs="+", default=sorted({m for m, _ in BUDGET_GB}), help="models to run")
    parser.add_argument("--smoke", action="store_true", help="SMOKE_BUDGET_GB's case only (CI's check)")
    args = parse_bench_args(parser, argv)
    budgets = SMOKE_BUDGET_GB if args.smoke else BUDGET_GB
    jobs = {f"{m}-{s}": budget_job(m, s, args.smoke) for m, s in budgets if m in args.models}
    rows = [bench_model(job) for job in jobs.values()]
    trial_counts = sorted(r["lightning"]["trial_runs"] for r in rows)
    figures = {
        "ours_max_rel_error": max(abs(r["ours"]["rel_error"]) for r in rows),
        "ours_ever_above_true": any(r["ours"]["above_true"] for r in rows),
        "ours_max_trial_runs": max(r["ours"]["trial_runs"] for r in rows),
        "lightning_trial_runs": {"min": trial_counts[0], "max": trial_counts[-1]},
        "targets": TARGETS,
        "met": all(
            abs(r["ours"]["rel_error"]) <= TARGETS["rel_error"]
            and not r["ours"]["above_true"]
            and r["ours"]["trial_runs"] <= TARGETS["trial_runs"]
            for r in rows
        ),
        "models": rows,
    }
    write_result(
        args.out,
        {
            "smoke": args.smoke,
            "budget_gb": {f"{m}-{s}": gb for (m, s), gb in budgets.items()},
            "lightning": LIGHTNING,
            "jobs": {name: job.as_dict() for name, job in jobs.items()},
        },
        figures,
    )
    print(
        f"\nours: within {figures['ours_max_rel_error']:.1%} of the true largest batch, "
        f"{'sometimes' if figures['ours_ever_above_true'] else 'never'} above it, in at most "
        f"{figures['ours_max_trial_runs']} trial runs (targets {TARGETS['rel_error']:.0%}, never above, "
        f"{TARGETS['trial_runs']}); Lightning-style search: {trial_counts[0]}-{trial_counts[-1]} trial runs"
    )
