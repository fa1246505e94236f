"""Benchmark: the largest per-device batch under a device budget, found three ways, counted in trial runs.

A trial run is `memory.trial_step`: a fresh process with the device limited to the budget (the budget
allocator: a real out-of-memory error past it) running two real training steps of the job at one batch,
exactly as the probe stage verifies a batch. For each model:
- true: the largest batch that fits, by bisection between a batch that fits and one that does not;
- ours: the probe stage (3 measurement probes, then at most 2 verification trials), headroom 0;
- lightning: PyTorch Lightning's batch-size finder, mode "binsearch" (init_val 2, doubling until the
  first failure, then bisection between the last success and the first failure; reimplemented here,
  one trial per process as above rather than Lightning's in-process retries).

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/max_batch_search.py
Writes bench/results/max_batch_search.json.
"""

from __future__ import annotations

import time

from common import bench_parser, write_result
from memory_accuracy import MODELS, model_job

# Budgets whose largest batch stays below the digits training set (1258 samples), beyond which the probe
# stage does not verify (no device of this job ever sees a larger batch).
BUDGET_GB = {"tiny_cnn": 0.06, "resnet18": 1.0, "mobilenet_v3_small": 1.0, "vgg11": 1.0}
LIGHTNING = {"init_val": 2, "max_trials": 25}
TARGETS = {"rel_error": 0.05, "trial_runs": 2}


class Trials:
    """Counts trial runs of one job under its budget; each is a fresh process."""

    def __init__(self, job: dict):
        from tula_hpc.budget import budget_bytes

        self.job, self.budget, self.runs, self.seconds = job, budget_bytes(job), 0, 0.0

    def fits(self, batch: int) -> bool:
        from tula_hpc.memory import run_in_fresh_process

        started = time.perf_counter()
        answer = run_in_fresh_process("trial", job=self.job, batch=batch, budget=self.budget, ddp=False)
        self.runs += 1
        self.seconds += time.perf_counter() - started
        return answer["outcome"] == "fits"


def true_largest(trials: Trials, guess: int) -> int:
    """Bisection between a batch that fits and one that does not, bracketed around `guess`."""
    low, high = max(1, guess // 2), 2 * guess
    while not trials.fits(low):
        low, high = max(1, low // 2), low
    while trials.fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if trials.fits(middle) else (low, middle)
    return low


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


def ours(job: dict) -> dict:
    from tula_hpc.memory import probe_worker, summarise

    started = time.perf_counter()
    measured = probe_worker(job)
    result = summarise(job, measured)
    return {
        "batch": result["max_batch_per_device"],
        "predicted_batch": result["predicted_max_batch"],
        "verified": result["verified"],
        "trial_runs": len(measured["trials"]),
        "probe_runs": len(measured["probes"]),
        "seconds": time.perf_counter() - started,
    }


def budget_job(model: str) -> dict:
    """The model's job under its budget, on one device (no DDP buckets, as in the trials), headroom 0."""
    return model_job(
        model,
        MODELS[model][0],
        resources={"device_memory_gb": BUDGET_GB[model], "memory_headroom": 0.0},
        search={"nodes": {"max": 1}},
    )


def bench_model(job: dict) -> dict:
    model, side = job["model"]["name"], job["data"]["image_size"]
    found = ours(job)
    truth_trials = Trials(job)
    truth = true_largest(truth_trials, found["batch"])
    lightning_trials = Trials(job)
    lightning = lightning_binsearch(lightning_trials)
    row = {
        "model": model,
        "input": [1, side, side],
        "budget_bytes": truth_trials.budget,
        "strategy": job["train"]["strategy"],
        "true_max_batch": truth,
        "true_search_trial_runs": truth_trials.runs,
        "ours": {**found, "rel_error": abs(found["batch"] - truth) / truth},
        "lightning": {
            "batch": lightning,
            "trial_runs": lightning_trials.runs,
            "seconds": lightning_trials.seconds,
            "rel_error": abs(lightning - truth) / truth,
        },
    }
    print(
        f"{model:20s} true {truth:5d} | ours {found['batch']:5d} in {found['trial_runs']} trial(s) + "
        f"{found['probe_runs']} probes, {found['seconds']:.0f} s | lightning {lightning:5d} in "
        f"{lightning_trials.runs} trials, {lightning_trials.seconds:.0f} s",
        flush=True,
    )
    return row


def main() -> None:
    parser = bench_parser(__doc__, "max_batch_search.json")
    parser.add_argument("--models", nargs="+", default=list(BUDGET_GB), choices=list(BUDGET_GB))
    args = parser.parse_args()
    jobs = {model: budget_job(model) for model in args.models}
    rows = [bench_model(job) for job in jobs.values()]
    figures = {
        "ours_max_rel_error": max(r["ours"]["rel_error"] for r in rows),
        "ours_max_trial_runs": max(r["ours"]["trial_runs"] for r in rows),
        "lightning_median_trial_runs": sorted(r["lightning"]["trial_runs"] for r in rows)[len(rows) // 2],
        "targets": TARGETS,
        "models": rows,
    }
    write_result(args.out, {"budget_gb": BUDGET_GB, "lightning": LIGHTNING, "jobs": jobs}, figures)
    print(
        f"\nours: within {figures['ours_max_rel_error']:.1%} of the true largest batch in at most "
        f"{figures['ours_max_trial_runs']} trial runs (targets {TARGETS['rel_error']:.0%}, {TARGETS['trial_runs']}); "
        f"Lightning-style search: {figures['lightning_median_trial_runs']} trial runs (median)"
    )


if __name__ == "__main__":
    main()
