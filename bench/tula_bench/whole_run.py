"""perf_accuracy's figure of a whole short training run as it really runs (issue 40): its warm-up and epoch ends
counted, against the prediction the stages make from a profile.

For each of MODELS and CONFIGS (ranks as local processes, per-device batch b), REPEATS times: the profile stage's
worker in a fresh job (as the profile stage launches it, so its warm-up steps are a fresh process's first steps), then
the train stage's worker in a fresh job for EPOCHS epochs (a fresh folder: it never resumes). The prediction is
prediction.fit_and_predict on that one profile at its own configuration (select's view of a profiled candidate), the
truth the run's own clock: train_time_s and metrics.jsonl's epoch_time_s, the span T predicts.

Figures, pooled over models and configurations, each over every (profile, run) pair of a configuration:
- whole_run: |predicted T / measured train_time_s - 1| (all EPOCHS epochs, the first included);
- first_epoch and steady_epoch (the third: the second holds AGS's first split-batch step): the same per epoch;
- steps_only: the whole run as predicted before issue 40 (E x the steps of an epoch), for comparison;
- each one's noise floor: a run's measured figure over the median of its configuration's other runs, |x / m - 1|,
  median: how far one run lands from its repeats. Target: whole_run within WHOLE_RUN_TARGET x its noise floor.

Alone (without perf_accuracy's step-time rounds), on the CPU: perf_accuracy's digits models and CONFIGS,
    flock /tmp/tula-cpu.lock .venv/bin/python bench/whole_run.py      (about 5 min; bench/results/whole_run_cpu.json)
and on one GPU, the GPU-shaped case (resnet18 at 32 px on digits, b=128, fp32, AGS; 10 steps an epoch):
    bash scripts/gpu-python.sh bench/whole_run.py --gpu   (about 70 s on the H200; bench/results/whole_run_gpu.json)
`--smoke` runs SMOKE_CONFIGS once for the tiny CNN in a temporary folder: the continuous-integration check that the
bench runs end to end (no noise floor without repeats).
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from tula_bench.common import (
    GPU_CASES,
    RESULTS,
    WORK,
    bench_job,
    bench_parser,
    new_case_path,
    parse_bench_args,
    provenance,
    smoke_scratch,
    verdict,
)
from tula_bench.perf_replay import stage_prediction

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

MODELS = ("tiny_cnn", "resnet18")  # the digits models: an epoch of Fashion-MNIST takes minutes here
CONFIGS = ((1, 32), (2, 32))  # (ranks, per-device batch): 40 and 20 steps per epoch of the digits
GPU_CONFIGS = ((1, 128),)  # the GPU check's trained configuration: 10 steps per epoch
SMOKE_MODELS, SMOKE_CONFIGS = ("tiny_cnn",), ((1, 256),)  # --smoke: 5 steps an epoch, one rank
EPOCHS = 3
REPEATS = 3
GPU_WHAT = (
    f"resnet18 at 32 px on digits (fp32, AGS, the default job's training settings) at N=1, b=128 (10 steps an "
    f"epoch), {REPEATS} repeats apart in time, each a profile in a fresh process then training in another"
)
WHOLE_RUN_TARGET = 1.5
CASES = GPU_CASES / "whole_run"  # recorded GPU runs (README one folder up)


def short_run_job(job: Job) -> Job:
    return job.updated(train={"epochs": EPOCHS, "lr_milestones": []})


def _fresh(folder):
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def one_run(job: Job, nodes: int, per_device: int, folder) -> dict:
    """A profile in a fresh job, then EPOCHS epochs of training in another: the record, the run's epochs."""
    from tula_hpc.cluster import launch
    from tula_hpc.core.run_layout import devices_per_node, ranks_per_host
    from tula_hpc.profiling.step_timing import profile_worker
    from tula_hpc.training.trainer import train_worker

    spec = launch.LaunchSpec.for_job(job, nodes=nodes)
    batch = per_device * spec.world_size
    work = _fresh(folder / "profile")
    profile = launch.run(
        profile_worker, dict(job=job, global_batch=batch, checkpoint_dir=str(work)), spec, work, name="bench-profile"
    )
    profile.pop("per_step")
    profile.update(nodes=nodes, ranks_per_host=ranks_per_host(job.launcher, nodes, devices_per_node(job)))
    work = _fresh(folder / "train")
    paths = {name: str(work / f"{name}.{ext}") for name, ext in (("checkpoint", "pt"), ("model", "pt"))}
    summary = launch.run(
        train_worker,
        dict(
            job=job,
            global_batch=batch,
            checkpoint_path=paths["checkpoint"],
            model_path=paths["model"],
            metrics_path=str(work / "metrics.jsonl"),
        ),
        spec,
        work,
        name="bench-train",
    )
    return {
        "profile": profile,
        "train_time_s": summary["train_time_s"],
        "epoch_time_s": [record["epoch_time_s"] for record in summary["history"]],
        "data_wait_s": [record["data_wait_s"] for record in summary["history"]],
    }


def measure(
    jobs: dict[str, Job], configs: tuple = CONFIGS, repeats: int = REPEATS, scratch: Path = WORK / "whole_run"
) -> list[dict]:
    """Every model of `jobs`, configuration and repeat (repeats of one configuration apart in time)."""
    runs = []
    for repeat in range(repeats):
        for model in jobs:
            for nodes, per_device in configs:
                folder = scratch / f"{model}_N{nodes}_b{per_device}"
                run = one_run(short_run_job(jobs[model]), nodes, per_device, folder)
                runs.append({"model": model, "nodes": nodes, "per_device_batch": per_device, "repeat": repeat, **run})
                print(
                    f"whole run {model} N={nodes} b={per_device} repeat {repeat}: epochs "
                    f"{', '.join(f'{t:.3f}' for t in run['epoch_time_s'])} s",
                    flush=True,
                )
    return runs


def predicted(job: Job, run: dict, train_samples: int) -> dict:
    """The stages' prediction of the run from its own profile: T, each epoch, and T of the steps alone."""
    from tula_hpc.performance.epochs import epoch_times
    from tula_hpc.performance.fitting import model_params

    job = job.updated(train={"epochs": len(run["epoch_time_s"]), "lr_milestones": []})  # as many as the run trained
    candidate = {"nodes": run["nodes"], "batch": run["profile"]["global_batch"]}
    candidate["per_device_batch"] = run["per_device_batch"]
    [row] = stage_prediction(job, [run["profile"]], [candidate], train_samples, model_params(job))
    return {
        "time_s": row["time_s"],
        "epoch_time_s": epoch_times(row, job.train.epochs),
        "steps_only_s": job.train.epochs * (row["epoch_s"] - row["epoch_start_s"]),
        "terms": {k: row[k] for k in ("warmup_first_s", "warmup_second_s", "epoch_start_s", "outside_epoch_s")},
    }


FIGURES = {  # figure -> (the measured side of a run, the predicted side)
    "whole_run": (lambda run: run["train_time_s"], lambda p: p["time_s"]),
    "first_epoch": (lambda run: run["epoch_time_s"][0], lambda p: p["epoch_time_s"][0]),
    "steady_epoch": (lambda run: run["epoch_time_s"][-1], lambda p: p["epoch_time_s"][-1]),
    "steps_only": (lambda run: run["train_time_s"], lambda p: p["steps_only_s"]),
}


def _noise(values: list[float]) -> list[float]:
    """Each run against the median of its repeats (none for a run that was not repeated)."""
    if len(values) < 2:
        return []
    return [abs(v / statistics.median(values[:i] + values[i + 1 :]) - 1) for i, v in enumerate(values)]


def analyse(runs: list[dict], jobs: dict[str, Job], train_samples: dict[str, int]) -> dict:
    """Each figure's median error over every (profile, run) pair of a configuration and its noise floor, pooled."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        run["predicted"] = predicted(jobs[run["model"]], run, train_samples[run["model"]])
        groups.setdefault((run["model"], run["nodes"], run["per_device_batch"]), []).append(run)
    figures = {}
    for name, (measured, predicted_side) in FIGURES.items():
        errors, noise = [], []
        for group in groups.values():
            truth = [measured(run) for run in group]
            errors += [abs(predicted_side(p["predicted"]) / m - 1) for p in group for m in truth]
            noise += _noise(truth)
        floor = statistics.median(noise) if noise else None  # no configuration repeated: no floor to judge on
        median = statistics.median(errors)
        figures[name] = {"median_rel_error": median, "max_rel_error": max(errors), "noise_floor": floor}
        figures[name]["over_noise_floor"] = median / floor if floor else None
    whole = figures["whole_run"]
    return {
        "settings": {
            "epochs": sorted({len(run["epoch_time_s"]) for run in runs}),
            "repeats": max(map(len, groups.values())),
        },
        "figures": figures,
        "target": verdict(whole["over_noise_floor"], WHOLE_RUN_TARGET),
        "runs": runs,
    }


def case_record(what: str, recorded: dict, job: Job, train_samples: int, runs: list[dict]) -> dict:
    """Runs as a whole-run case keeps them (bench/data/gpu/README.md; bench/whole_run_replay.py predicts them again):
    the measured side only, each run's profile and clock."""
    kept = [{key: value for key, value in run.items() if key != "predicted"} for run in runs]
    return {"what": what, "recorded": recorded, "job": job.as_dict(), "train_samples": train_samples, "runs": kept}


def report(analysis: dict) -> None:
    for name, f in analysis["figures"].items():
        floor = "none (no configuration repeated)" if f["noise_floor"] is None else f"{f['noise_floor']:.1%}"
        over = "" if f["over_noise_floor"] is None else f": {f['over_noise_floor']:.2f}x"
        print(
            f"whole-run {name:13s} median {f['median_rel_error']:.1%} (max {f['max_rel_error']:.1%}), noise floor "
            f"{floor}{over}"
        )
    target = analysis["target"]
    figure = "no noise floor" if target["figure"] is None else f"{target['figure']:.2f}x noise floor"
    met = "met" if target["met"] else "NOT met"
    print(f"target whole_run          {met}: {figure} (target <= {target['target']}x)")


def gpu_job() -> Job:
    """The GPU-shaped case: resnet18 at 32 px on digits, one GPU, the default job's training settings."""
    return bench_job(
        as_name="gpu-whole-run",
        model={"name": "resnet18", "kwargs": {}},
        data={"name": "digits", "image_size": 32},
        resources={"gpus_per_node": 1, "device_memory_gb": 8, "cpus_per_task": 4},
        search={"warmup_steps": 3, "steps": 10, "min_measure_s": 0.5, "nodes": {"min": 1, "max": 1}},
    )


def main(argv: list[str] | None = None) -> int:
    from tula_bench.perf_jobs import bench_jobs
    from tula_hpc.core.atomic_files import write_json
    from tula_hpc.training.datasets import load_splits

    parser = bench_parser(__doc__, "whole_run_cpu.json")
    parser.add_argument("--gpu", action="store_true", help="the GPU-shaped case on this machine's GPU")
    parser.add_argument("--smoke", action="store_true", help="the smallest CPU case once, in a temporary folder")
    args = parse_bench_args(parser, argv)
    if args.gpu and args.smoke:
        parser.error("--smoke is the CPU case's: a --gpu run records a case for the replay")
    out = RESULTS / "whole_run_gpu.json" if args.gpu and args.out == parser.get_default("out") else args.out
    if args.gpu:
        jobs, configs = {"resnet18": gpu_job()}, GPU_CONFIGS
    else:
        models = SMOKE_MODELS if args.smoke else MODELS
        jobs = {m: job for m, job in bench_jobs("local").items() if m in models}
        configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    if args.smoke:
        runs = measure(jobs, configs, repeats=1, scratch=smoke_scratch("whole-run"))
    else:
        runs = measure(jobs, configs)
    samples = {m: len(load_splits(job.data, job.train.seed).train) for m, job in jobs.items()}
    analysis = analyse(runs, jobs, samples)
    analysis["settings"]["smoke"] = args.smoke
    found = provenance()
    write_json(out, {"provenance": found, "jobs": {m: job.as_dict() for m, job in jobs.items()}, **analysis})
    if args.gpu:  # kept for the replay: every later change to the prediction is judged on it
        recorded = {"device": {"name": found["gpus"][0]}, "git_commit": found["git_commit"], "torch": found["torch"]}
        what = f"bench/whole_run.py --gpu: {GPU_WHAT}"
        case = case_record(what, recorded, jobs["resnet18"], samples["resnet18"], runs)
        write_json(path := new_case_path(CASES, found["gpus"][0], "resnet18_32_fp32"), case)
        print(f"wrote {path}", flush=True)
    report(analysis)
    return 0
