"""Benchmark: how well the memory model predicts a training step's peak device memory at large batches.

For each model (digits resized to the model's input side, one channel) the probe stage's own measurement
(`memory.measure_probe`, a fresh process per batch) runs at the job's probe batches; the fitted model
then predicts the peak at batches up to 64x the largest probe, and each prediction is compared with the
same measurement at that batch (ground truth: the profiler's allocator timeline of one steady training
step, cross-checked by the budget allocator's own peak count). Also reported, fitted on the same probes:
- peak_line: one line through the probes' peaks (the paper's fit);
- eq3_sum: M_param + M_grad + M_opt + M_act(b) + M_batch(b), each term measured on the real model and
  extrapolated linearly (the paper's Eq. 3 accounting; it leaves out the workspace alive at the peak).

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/memory_accuracy.py
Writes bench/results/memory_accuracy.json.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from common import bench_job, bench_parser, write_result
from sklearn.linear_model import LinearRegression

# model -> (input side, batches to predict); the probes are the job's (32, 48, 64 by default).
MODELS = {
    "tiny_cnn": (8, [128, 512, 1024, 2048, 4096]),
    "resnet18": (32, [96, 128, 256, 512, 640]),
    "mobilenet_v3_small": (32, [96, 128, 256, 512, 768]),
    "vgg11": (32, [96, 128, 256, 512, 768]),
}
TARGETS = {"median_rel_error": 0.03, "max_rel_error": 0.08, "min_batch_over_largest_probe": 8}
EQ3_TERMS = ("activation_bytes", "batch_bytes")
FIXED_TERMS = ("param_bytes", "buffer_bytes", "grad_bytes", "optimizer_bytes")


def model_job(model: str, side: int, **sections) -> dict:
    """The default job with another model, on digits resized to the model's input side."""
    return bench_job(as_name=f"bench-{model}", model={"name": model}, data={"image_size": side}, **sections)


def eq3_prediction(probes: list[dict], batch: int) -> float:
    """Paper Eq. 3 with measured terms: the fixed ones as measured, the batch-dependent ones fitted linearly."""
    x = np.reshape([p["batch"] for p in probes], (-1, 1))
    growing = LinearRegression().fit(x, [[p[t] for t in EQ3_TERMS] for p in probes]).predict([[batch]])[0]
    return float(sum(probes[-1][t] for t in FIXED_TERMS) + growing.sum())


def bench_model(job: dict, batches: list[int]) -> tuple[list[dict], dict]:
    from tula_hpc.memory import StepMemoryModel, fit_probes, run_in_fresh_process

    model, side = job["model"]["name"], job["data"]["image_size"]
    started = time.perf_counter()
    probes = [run_in_fresh_process("measure", job=job, batch=b) for b in job["resources"]["memory_probe_batches"]]
    probe_seconds = time.perf_counter() - started
    timeline = fit_probes(probes)
    peak_line = StepMemoryModel().fit([p["batch"] for p in probes], [p["measured_peak_bytes"] for p in probes])
    cases = []
    for batch in batches:
        truth = run_in_fresh_process("measure", job=job, batch=batch)
        measured = truth["measured_peak_bytes"]
        predicted = float(timeline.predict([batch])[0])
        case = {
            "model": model,
            "input": [1, side, side],
            "batch": batch,
            "strategy": job["train"]["strategy"],
            "predicted_bytes": round(predicted),
            "measured_bytes": measured,
            "rel_error": abs(predicted - measured) / measured,
            "allocator_peak_bytes": truth["allocator_peak_bytes"],
            "peak_line_rel_error": abs(peak_line.predict([batch])[0] - measured) / measured,
            "eq3_sum_rel_error": abs(eq3_prediction(probes, batch) - measured) / measured,
            "at_peak": truth["at_peak"],
        }
        cases.append(case)
        print(
            f"{model:20s} b={batch:5d} predicted {predicted / 1e6:9.2f} MB measured {measured / 1e6:9.2f} MB "
            f"error {case['rel_error']:.4%}  (peak line {case['peak_line_rel_error']:.2%}, "
            f"Eq. 3 sum {case['eq3_sum_rel_error']:.1%})",
            flush=True,
        )
    fit = {
        "model": model,
        "probe_batches": [p["batch"] for p in probes],
        "probe_seconds": probe_seconds,
        "kind": "timeline" if len(timeline.slopes_) > 1 else "peak_line",
        "timeline_points": len(timeline.slopes_),
        "rel_residual": timeline.rel_residual_,
    }
    return cases, fit


def summary(cases: list[dict], key: str) -> dict:
    errors = [c[key] for c in cases]
    return {"median_rel_error": statistics.median(errors), "max_rel_error": max(errors)}


def main() -> None:
    parser = bench_parser(__doc__, "memory_accuracy.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    # No budget: the measurements must see the whole step, however large.
    jobs = {m: model_job(m, MODELS[m][0], resources={"device_memory_gb": 1000}) for m in args.models}
    cases, fits = [], []
    for model, job in jobs.items():
        model_cases, fit = bench_model(job, MODELS[model][1])
        cases += model_cases
        fits.append(fit)
    largest_probe = max(max(f["probe_batches"]) for f in fits)
    figures = {
        **summary(cases, "rel_error"),
        "baselines": {
            "peak_line": summary(cases, "peak_line_rel_error"),
            "eq3_sum": summary(cases, "eq3_sum_rel_error"),
        },
        "largest_batch_over_largest_probe": max(c["batch"] for c in cases) / largest_probe,
        "targets": TARGETS,
        "fits": fits,
        "cases": cases,
    }
    write_result(args.out, {"models": {m: MODELS[m] for m in jobs}, "jobs": jobs}, figures)
    print(
        f"\nmemory model: median {figures['median_rel_error']:.4%}, max {figures['max_rel_error']:.4%} over "
        f"{len(cases)} cases (targets {TARGETS['median_rel_error']:.0%} / {TARGETS['max_rel_error']:.0%}); "
        f"peak line: median {figures['baselines']['peak_line']['median_rel_error']:.2%}, max "
        f"{figures['baselines']['peak_line']['max_rel_error']:.2%}; Eq. 3 sum: median "
        f"{figures['baselines']['eq3_sum']['median_rel_error']:.1%}"
    )


if __name__ == "__main__":
    main()
