"""The GPU check's step-time and DAG sections (bench/gpu_check.py runs them): the performance model against repeated
profiles and against the train stage's measured epochs, and the default DAG end to end.

Each section is a function of the device ("cuda" or "cpu"), the size preset (gpu_check.PRESETS) and a scratch folder;
it returns its figures and its verdicts.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
from common import (
    DEFAULT_JOB,
    JOBS_FILE,
    REPO,
    bench_config,
    bench_job,
    error_summary,
    merged,
    train_cell,
    verdict,
)
from gpu_memory import gpus

from tula_hpc.files import read_jsonl
from tula_hpc.job import Job

# A launched process cannot import bench/'s modules: its worker (steps_worker) travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
TARGETS = {"steptime_loo_median": 0.02, "epoch_time": 0.10}
# The performance model prices what it predicts; the check compares times only, so no memory price applies.
NO_MEMORY_PRICE = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}


# --- step time --------------------------------------------------------------------------------------


def steps_worker(jobs: dict[str, Job], schedule: list[dict]) -> list[dict]:
    """In a launched process: `step_timing.measure` at each scheduled (job, per-device batch), one rank."""
    from tula_hpc.distributed import init_distributed, shutdown
    from tula_hpc.step_timing import measure

    job = next(iter(jobs.values()))
    ctx = init_distributed(job.resources.gpus_per_node > 0)
    records = []
    for item in schedule:
        record = measure(jobs[item["case"]], ctx, item["per_device_batch"])
        record.pop("per_step")
        records.append({**item, **record, "nodes": 1, "ranks_per_host": 1})
        print(
            f"round {item['round']} {item['case']} b={item['per_device_batch']}: "
            f"{record['median']['step_s'] * 1e3:.3f} ms",
            flush=True,
        )
    shutdown()
    return records


def step_time_figures(records: list[dict], settings: dict) -> dict:
    """One case's noise floor and leave-one-out error over its rounds, as bench/perf_accuracy.py defines them."""
    from tula_hpc.performance import fit_profiles, profile_row

    rounds = sorted({r["round"] for r in records})
    by_round = {n: {r["per_device_batch"]: r for r in records if r["round"] == n} for n in rounds}
    batches = sorted(by_round[rounds[0]])

    def step(record: dict) -> float:
        return record["median"]["step_s"]

    def truth(batch: int, excluded: int) -> float:
        others = [by_round[n][batch] for n in rounds if n != excluded]
        quiet = [r for r in others if r["interference"] <= settings["interference_tolerance"]] or others
        return statistics.median(map(step, quiet))

    noise, loo = {}, {}
    for n in rounds:
        for batch in batches:
            label = f"round {n} b={batch}"
            noise[label] = step(by_round[n][batch]) / truth(batch, n) - 1
            model = fit_profiles([by_round[n][b] for b in batches if b != batch], **settings)
            loo[label] = float(model.predict([profile_row(by_round[n][batch])])[0] / truth(batch, n) - 1)
    per_batch = {
        str(b): {
            "step_s": statistics.median(step(by_round[n][b]) for n in rounds),
            "loo_rel_error": statistics.median(abs(loo[f"round {n} b={b}"]) for n in rounds),
            "noise": statistics.median(abs(noise[f"round {n} b={b}"]) for n in rounds),
        }
        for b in batches
    }
    floor, errors = error_summary(noise), error_summary(loo)
    return {
        "noise_floor": floor["median_rel_error"],
        "noise_max": floor["max_rel_error"],
        "loo": errors,
        "loo_over_noise_floor": errors["median_rel_error"] / floor["median_rel_error"]
        if floor["median_rel_error"]
        else None,
        "per_batch": per_batch,
        "rounds": len(rounds),
    }


def profiled_rounds(device: str, spec: dict, scratch: Path) -> tuple[dict[str, Job], dict, list[dict]]:
    """(jobs, grids, records): `step_timing.measure` over each case's whole batch axis at N = 1 (the plan stage's
    grid of a full search), in shuffled rounds inside one launched process."""
    from tula_hpc import launch
    from tula_hpc.data import load_splits
    from tula_hpc.plan import candidate_grid

    jobs = {
        f"{case['model']}-{case['image_size']}": bench_job(
            as_name=f"gpu-check-steps-{case['model']}-{case['image_size']}",
            model={"name": case["model"]},
            data={"name": "digits", "image_size": case["image_size"]},
            train={"epochs": spec["epochs_trained"], "lr_milestones": []},
            resources={"gpus_per_node": gpus(device)},
            search={**spec["measurement"], "mode": "full", "nodes": {"min": 1, "max": 1}, "batch": spec["batch"]},
        )
        for case in spec["cases"]
    }
    first = next(iter(jobs.values()))
    train_samples = len(load_splits(first.data, first.train.seed).train)
    grids = {name: candidate_grid(job.search, spec["batch"]["max"], train_samples) for name, job in jobs.items()}
    rng, schedule = random.Random(0), []
    for n in range(spec["rounds"]):
        order = [
            {"round": n, "case": name, "per_device_batch": c["per_device_batch"]}
            for name, g in grids.items()
            for c in g
        ]
        rng.shuffle(order)
        schedule += order
    records = launch.run(
        steps_worker,
        dict(jobs=jobs, schedule=schedule),
        launch.LaunchSpec.for_job(first, nodes=1),
        scratch / "steptime",
        name="gpu-check-steptime",
    )
    return jobs, grids, records


def epoch_check(job: Job, grid: list[dict], profiles: list[dict], folder: Path) -> dict:
    """The train stage's measured epochs (metrics.jsonl's epoch_time_s) at the middle of the profiled grid against
    the epoch the performance model predicts there, fitted and used as the perfmodel stage does on `profiles` (one
    round: what the profile stage gives). The first epoch (loader start, kernel choice) is reported, not judged."""
    from tula_hpc.data import load_splits
    from tula_hpc.fit_model import fit_and_predict
    from tula_hpc.performance import model_params

    candidate = grid[len(grid) // 2]
    train_samples = len(load_splits(job.data, job.train.seed).train)
    _, _, _, [row] = fit_and_predict(job, profiles, [candidate], train_samples, NO_MEMORY_PRICE, model_params(job))
    summary = train_cell(job, candidate["batch"], folder, world=1, name=f"{job.name}-train")
    epochs = [r["epoch_time_s"] for r in read_jsonl(folder / "metrics.jsonl")]
    errors = {f"epoch {i + 1}": t / row["epoch_s"] - 1 for i, t in enumerate(epochs)}
    judged = dict(list(errors.items())[1:]) or errors
    return {
        "batch": candidate["batch"],
        "steps_per_epoch": summary["steps_per_epoch"],
        "predicted_epoch_s": row["epoch_s"],
        "predicted_step_s": row["step_s"],
        "measured_epoch_s": epochs,
        "rel_errors": errors,
        "median_rel_error": error_summary(judged)["median_rel_error"],
    }


def steptime_section(device: str, preset: dict, scratch: Path) -> dict:
    from tula_hpc.performance import model_params

    spec, started = preset["steptime"], time.perf_counter()
    jobs, grids, records = profiled_rounds(device, spec, scratch)
    measure_seconds = time.perf_counter() - started
    cases = {
        name: step_time_figures([r for r in records if r["case"] == name], model_params(job))
        for name, job in jobs.items()
    }
    for name, job in jobs.items():
        profiles = [r for r in records if r["case"] == name and r["round"] == 0]
        cases[name]["trained"] = epoch_check(job, grids[name], profiles, scratch / "steptime" / f"train-{name}")
    median = statistics.median(c["loo"]["median_rel_error"] for c in cases.values())
    epoch = statistics.median(c["trained"]["median_rel_error"] for c in cases.values())
    return {
        "description": "step time at N=1 over the batch axis: noise floor of repeated measurements and the "
        "performance model's leave-one-out error (full search), medians over rounds and batches; the train "
        "stage's measured epochs at a profiled batch against the model's predicted epoch; overall: median over cases",
        "loo_median_rel_error": median,
        "epoch_median_rel_error": epoch,
        "noise_floor": statistics.median(c["noise_floor"] for c in cases.values()),
        "measure_seconds": measure_seconds,
        "verdicts": {
            "loo_median": verdict(median, TARGETS["steptime_loo_median"]),
            "trained_epoch_median": verdict(epoch, TARGETS["epoch_time"]),
        },
        "cases": cases,
        "jobs": {name: job.as_dict() for name, job in jobs.items()},
        "measurements": records,
    }


# --- the DAG ---------------------------------------------------------------------------------------


def dag_section(device: str, preset: dict, scratch: Path) -> dict:
    """The default DAG on one device at N = 1, in a scratch folder, through the local profile."""
    import yaml

    from tula_hpc.files import read_json

    spec = preset["dag"]
    folder = scratch / "dag"
    folder.mkdir(parents=True, exist_ok=True)
    job = merged(
        {
            "resources": {"gpus_per_node": gpus(device), "device_memory_gb": "auto"},  # the card sizes the batch
            "search": {"nodes": {"min": 1, "max": 1}},
        },
        spec["changes"],
    )
    bench_config(DEFAULT_JOB, **job)  # a bad preset fails here, naming the field
    override = folder / "gpu-check.yaml"
    override.write_text(yaml.safe_dump({"targets": [DEFAULT_JOB], "jobs": {DEFAULT_JOB: job}}))  # that job alone
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(folder)]
    cmd += ["--profile", str(REPO / "profiles" / "local"), "--configfile", str(JOBS_FILE), str(override)]
    started, log, timed_out = time.perf_counter(), folder / "snakemake.log", False
    with (
        open(log, "w") as output,
        subprocess.Popen(cmd, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True) as proc,
    ):
        try:
            returncode = proc.wait(timeout=spec["timeout_s"])
        except subprocess.TimeoutExpired:  # Snakemake and every stage it started: their own process group
            os.killpg(proc.pid, signal.SIGKILL)
            returncode, timed_out = proc.wait(), True
            output.write(f"\ngpu-check: killed after {spec['timeout_s']} s\n")
    wall = time.perf_counter() - started
    results = folder / "results" / DEFAULT_JOB
    found = {}
    for name in ("memory.json", "selection.json", "train/summary.json", "eval.json"):
        if (results / name).exists():
            found[name] = read_json(results / name)
    completed = returncode == 0 and "eval.json" in found and (results / "report.md").exists()
    chosen = found.get("selection.json", {}).get("chosen", {})
    evaluation = found.get("eval.json", {})
    probes = found.get("memory.json", {}).get("probes", [])
    return {
        "description": "config/jobs.yaml's job on one device, N = 1 only, snakemake --profile profiles/local",
        "command": cmd,
        "changes": job,
        "returncode": returncode,
        "timed_out": timed_out,
        "wall_s": wall,
        "chosen": {k: chosen.get(k) for k in ("nodes", "batch", "per_device_batch", "time_s", "cost")},
        "test_accuracy": evaluation.get("test_accuracy"),
        "measured_train_time_s": evaluation.get("measured_train_time_s"),
        "predicted_train_time_s": evaluation.get("predicted_train_time_s"),
        "time_rel_error": evaluation.get("time_rel_error"),
        "max_batch_per_device": found.get("memory.json", {}).get("max_batch_per_device"),
        "device_memory_source": found.get("memory.json", {}).get("device_memory_source"),
        "probe_card_bytes": probes[0].get("card_bytes") if probes else None,
        "train_attempts": len(found.get("train/summary.json", {}).get("attempts", [])),
        "log": str(log),
        "log_tail": None if completed else log.read_text(errors="replace")[-4000:],
        "verdicts": {"completed": {"met": completed, "returncode": returncode}},
    }
