"""Benchmark: a loader slower than the step, predicted from short profiles (performance/loader_rate.py).

Why: a profile's few measured steps draw on batches its loader's workers made ahead (2 a worker), so they cannot show
a loader that cannot keep up; in a whole epoch it sets the pace. On the H200 at 3ca5bc3 resnet50's first epoch at b=32
ran 28 % slower than its profile's 20 steps of 20 ms predicted while three workers drew its 224 px images
(bench/data/gpu/whole_run: those profiles predate the loader's timing, so the replay cannot judge this). Here the same
regime on the CPU: the default job's tiny_cnn at b=256 (a step of about 25 ms: the job's default search settings then
measure 20 steps too) on the digits repeated to SIZE images, read through
`tula_bench.slow_storage.digits_behind_latency` with WORKERS loader workers, each image LATENCY_MS away (a network
file system's round trip), against a control with none.

For each case, REPEATS times: bench/whole_run.py's `one_run` (the profile stage's worker in a fresh job, then the
train stage's worker for its epochs in another) and `analyse` (each figure's median error over every (profile, run)
pair, and its noise floor: a run against its repeats), twice: with today's prediction, and with the profile's loader
timing taken out (the step alone, as before the loader was timed).

Target: the loader-bound case's steady epochs (the third) and whole run within 10 % of the prediction with the
loader's pace; the control's figures the same with or without it (no floor where the loader keeps up).

Run:  .venv/bin/python bench/loader_pace.py     (about 2 min; bench/results/loader_pace.json)
`--smoke` runs each case once on SMOKE_SIZE images in a temporary folder: the continuous-integration check that the
bench runs end to end (its figures are one run's, without a noise floor).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from tula_bench.common import (
    BENCH,
    WORK,
    bench_job,
    bench_parser,
    parse_bench_args,
    provenance,
    smoke_scratch,
    verdict,
    write_and_report,
)
from tula_bench.whole_run import analyse, one_run, short_run_job

LATENCY_MS = {"loader_bound": 0.45, "control": 0.0}  # 256 images: a worker's batch about 130 ms, 3 ~ 1.7 steps
PER_DEVICE_BATCH = 256
WORKERS = 3  # a GPU job's with 4 cores a rank (data.num_workers auto)
SIZE = 20_000
REPEATS = 3
SMOKE_SIZE = 2_000  # --smoke: 6 steps an epoch, once
TARGET = 0.10
FIGURES = ("whole_run", "first_epoch", "steady_epoch")
JUDGED = ("whole_run", "steady_epoch")  # the loader-bound case's figures held to TARGET


def case_job(name: str, latency_ms: float, size: int = SIZE):
    kwargs = {"latency_ms": latency_ms, "size": size}
    data = {"name": "tula_bench.slow_storage:digits_behind_latency", "kwargs": kwargs, "num_workers": WORKERS}
    return bench_job(as_name=f"loader-pace-{name}", data=data, resources={"cpus_per_task": 1})


def without_loader(runs: list[dict]) -> list[dict]:
    """The runs with their profiles' loader timing taken out: the prediction of the step alone."""
    runs = copy.deepcopy(runs)
    for run in runs:
        run["profile"]["loader"] = None
    return runs


def measure_case(name: str, job, repeats: int = REPEATS, scratch: Path = WORK / "loader_pace") -> dict:
    """`repeats` whole runs of `job` (1 rank, PER_DEVICE_BATCH) and both predictions of them."""
    from tula_hpc.training.datasets import load_splits

    runs = []
    for repeat in range(repeats):
        run = one_run(short_run_job(job), 1, PER_DEVICE_BATCH, scratch / name)
        runs.append({"model": name, "nodes": 1, "per_device_batch": PER_DEVICE_BATCH, "repeat": repeat, **run})
        loader = run["profile"]["loader"]
        print(
            f"{name} repeat {repeat}: epochs {', '.join(f'{t:.3f}' for t in run['epoch_time_s'])} s, data wait "
            f"{', '.join(f'{t:.3f}' for t in run['data_wait_s'])} s; profile step "
            f"{run['profile']['median']['step_s'] * 1e3:.2f} ms, the loader's pace {loader['period_s'] * 1e3:.2f} ms",
            flush=True,
        )
    jobs, samples = {name: job}, {name: len(load_splits(job.data, job.train.seed).train)}
    with_pace, step_alone = analyse(runs, jobs, samples), analyse(without_loader(runs), jobs, samples)
    return {
        "latency_ms": LATENCY_MS[name],
        "figures": {f: with_pace["figures"][f] for f in FIGURES},
        "figures_step_alone": {f: step_alone["figures"][f] for f in FIGURES},
        "runs": runs,  # each with its prediction (the loader's pace counted)
    }


def verdicts(cases: dict) -> dict:
    bound, control = cases["loader_bound"], cases["control"]
    found = {f"loader_bound_{f}": verdict(bound["figures"][f]["median_rel_error"], TARGET) for f in JUDGED}
    changed = max(
        abs(control["figures"][f]["median_rel_error"] - control["figures_step_alone"][f]["median_rel_error"])
        for f in FIGURES
    )
    found["control_unchanged"] = verdict(changed, 0.005)
    return found


def report(result: dict) -> None:
    for name, case in result["cases"].items():
        for figure in FIGURES:
            with_pace, alone = case["figures"][figure], case["figures_step_alone"][figure]
            floor = with_pace["noise_floor"]
            print(
                f"{name:12s} {figure:12s} median error {with_pace['median_rel_error']:6.1%} with the loader's pace, "
                f"{alone['median_rel_error']:6.1%} with the step alone (noise floor "
                f"{'-' if floor is None else f'{floor:.1%}'})"
            )
    for name, found in result["verdicts"].items():
        print(f"{name:28s} {'met' if found['met'] else 'NOT met'}: {found['figure']:.1%} (target {found['target']})")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "loader_pace.json")
    parser.add_argument("--smoke", action="store_true", help="each case once, small, in a temporary folder")
    args = parse_bench_args(parser, argv)
    # The data set is a user's module in bench/: the launched workers import it too.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
    size, repeats = (SMOKE_SIZE, 1) if args.smoke else (SIZE, REPEATS)
    scratch = smoke_scratch("loader-pace") if args.smoke else WORK / "loader_pace"
    cases = {
        name: measure_case(name, case_job(name, latency, size), repeats, scratch)
        for name, latency in LATENCY_MS.items()
    }
    settings = {
        "smoke": args.smoke,
        "latency_ms": LATENCY_MS,
        "per_device_batch": PER_DEVICE_BATCH,
        "workers": WORKERS,
        "size": size,
        "repeats": repeats,
        "target": TARGET,
    }
    result = {"verdicts": verdicts(cases), "provenance": provenance(), "settings": settings, "cases": cases}
    return write_and_report(args.out, result, report)
