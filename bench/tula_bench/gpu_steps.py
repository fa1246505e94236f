"""The GPU check's step-time and DAG sections (bench/gpu_check.py runs them): the performance model against repeated
profiles and against the train stage's measured epochs, and the default DAG end to end with each stage's wall time.

Each section is a function of the device ("cuda" or "cpu"), the size preset (gpu_plan.PRESETS), a scratch folder and
the run's context (its deadline); it returns its figures and its verdicts.
"""

from __future__ import annotations

import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import cloudpickle

from tula_bench.common import (
    DEFAULT_JOB,
    JOBS_FILE,
    REPO,
    bench_config,
    error_summary,
    merged,
    new_case_path,
    verdict,
)
from tula_bench.gpu_memory import gpus, workload_job
from tula_bench.gpu_plan import middle
from tula_hpc.core.atomic_files import read_jsonl, write_json
from tula_hpc.core.job import Job

# A launched process cannot import bench/'s modules: its worker (steps_worker) travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
TARGETS = {"steptime_loo_median": 0.02, "epoch_time": 0.10, "dag_s": 90.0}
# The performance model prices what it predicts; the check compares times only, so no memory price applies.
STEADY_FROM = 3  # the first epoch judged
NO_MEMORY_PRICE = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}
WHOLE_RUN_WHAT = (
    "the GPU check's steptime section (bench/gpu_steps.py): the train stage's worker at N=1 at a profiled batch, "
    "after the section's profiles in the same process (so neither pays a fresh process's first steps), its profile "
    "the first round's at that batch"
)


# --- step time --------------------------------------------------------------------------------------


def steps_worker(jobs: dict[str, Job], schedule: list[dict], folders: dict[str, str], batches: dict[str, int]) -> dict:
    """In a launched process: `step_timing.measure` at each scheduled (job, per-device batch), one rank; then the train
    stage's worker (`train.train_worker`, at N = 1 as the stage runs it) for each job at its profiled middle batch
    (`batches`: this worker travels by value, gpu_plan's `middle` would not), in `folders` (one launch for all: a
    launch's start is seconds of a short GPU slot)."""
    from tula_hpc.cluster.distributed import init_distributed, shutdown
    from tula_hpc.profiling.step_timing import measure
    from tula_hpc.training.trainer import train_worker

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
    trained = {}
    for name, folder in folders.items():
        files = [str(Path(folder) / f) for f in ("checkpoint.pt", "model.pt", "metrics.jsonl")]
        trained[name] = train_worker(jobs[name], batches[name], *files)
        print(f"trained {name}: {trained[name]['steps']} steps in {trained[name]['train_time_s']:.1f} s", flush=True)
    return {"records": records, "trained": trained}


def step_time_figures(records: list[dict], settings: dict) -> dict:
    """One case's noise floor and leave-one-out error over its rounds, as bench/perf_accuracy.py defines them."""
    from tula_hpc.performance.fitting import fit_profiles, profile_row

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


def profiled_rounds(device: str, spec: dict, scratch: Path) -> tuple[dict[str, Job], dict, dict, dict, dict]:
    """(jobs, grids, what the worker found, its training folders, training-set sizes): `step_timing.measure` over
    each case's whole batch axis at N = 1 (the plan stage's grid of a full search), in shuffled rounds inside one
    launched process."""
    from tula_hpc.cluster import launch
    from tula_hpc.stages.plan import candidate_grid
    from tula_hpc.training.datasets import load_splits

    jobs = {
        f"{case['model'].rsplit(':', 1)[-1]}-{case['image_size']}": workload_job(
            device,
            case,
            f"gpu-check-steps-{case['model'].rsplit(':', 1)[-1]}-{case['image_size']}",
            middle(case["batch"]["min"], case["batch"]["max"]),
            train={"epochs": spec["epochs_trained"], "lr_milestones": []},
            search={**spec["measurement"], "mode": "full", "batch": case["batch"]},
        )
        for case in spec["cases"]
    }
    samples = {name: len(load_splits(job.data, job.train.seed).train) for name, job in jobs.items()}
    grids = {name: candidate_grid(job.search, job.search.batch.max, samples[name]) for name, job in jobs.items()}
    first = next(iter(jobs.values()))
    rng, schedule = random.Random(0), []
    for n in range(spec["rounds"]):
        order = [
            {"round": n, "case": name, "per_device_batch": c["per_device_batch"]}
            for name, g in grids.items()
            for c in g
        ]
        rng.shuffle(order)
        schedule += order
    folders = {name: str(scratch / "steptime" / f"train-{name}") for name in jobs}
    trained_batches = {name: middle(job.search.batch.min, job.search.batch.max) for name, job in jobs.items()}
    found = launch.run(
        steps_worker,
        dict(jobs=jobs, schedule=schedule, folders=folders, batches=trained_batches),
        launch.LaunchSpec.for_job(first, nodes=1),
        scratch / "steptime",
        name="gpu-check-steptime",
    )
    return jobs, grids, found, folders, samples


def epoch_check(
    job: Job, grid: list[dict], train_samples: int, profiles: list[dict], summary: dict, folder: Path
) -> dict:
    """The train stage's measured epochs (`summary`, metrics.jsonl's epoch_time_s in `folder`) at a profiled batch
    against the epoch the performance model predicts there, fitted and used as the fit-model stage does
    on `profiles` (one round: what the profile stage gives). Epochs before STEADY_FROM (loader start, kernel choice,
    the allocator's growth) are reported, not judged."""
    from tula_hpc.performance.epochs import epoch_times
    from tula_hpc.performance.fitting import model_params
    from tula_hpc.performance.prediction import fit_and_predict

    [candidate] = [c for c in grid if c["batch"] == summary["global_batch"]]
    _, _, _, [row] = fit_and_predict(job, profiles, [candidate], train_samples, NO_MEMORY_PRICE, model_params(job))
    history = read_jsonl(folder / "metrics.jsonl")
    epochs = [r["epoch_time_s"] for r in history]
    predicted = epoch_times(row, len(epochs))  # the first with its warm-up, the second with AGS's first update
    errors = {f"epoch {i + 1}": t / p - 1 for i, (t, p) in enumerate(zip(epochs, predicted))}
    judged = dict(list(errors.items())[STEADY_FROM - 1 :])
    return {
        "batch": candidate["batch"],
        "steps_per_epoch": summary["steps_per_epoch"],
        "predicted_epoch_s": predicted,
        "first_epoch_rel_error": errors.get("epoch 1"),
        "predicted_step_s": row["step_s"],
        "measured_epoch_s": epochs,
        # How long the loop waited for its loader in each epoch: a loader that cannot keep up slows steady epochs
        # that the profile, its few batches drawn ahead, timed without it.
        "measured_data_wait_s": [r["data_wait_s"] for r in history],
        "rel_errors": errors,
        "median_rel_error": error_summary(judged)["median_rel_error"],
    }


def keep_whole_run(
    name: str, job: Job, train_samples: int, profiles: list[dict], summary: dict, trained: dict, context: dict
) -> Path:
    """The trained run (the train worker's `summary`, its epochs as `epoch_check` read them) and its profile, as a
    whole-run case for bench/whole_run_replay.py (<cases>/whole_run/)."""
    from tula_bench.whole_run import case_record

    [profile] = [p for p in profiles if p["global_batch"] == summary["global_batch"]]
    run = {"model": name, "nodes": 1, "per_device_batch": summary["global_batch"], "repeat": 0, "profile": profile}
    run |= {
        "train_time_s": summary["train_time_s"],
        "epoch_time_s": trained["measured_epoch_s"],
        "data_wait_s": trained["measured_data_wait_s"],
    }
    folder = context["cases_dir"] / "whole_run"
    folder.mkdir(parents=True, exist_ok=True)
    path = new_case_path(folder, context["recorded"]["device"]["name"], name)
    write_json(path, case_record(WHOLE_RUN_WHAT, context["recorded"], job, train_samples, [run]))
    return path


def steptime_section(device: str, preset: dict, scratch: Path, context: dict) -> dict:
    from tula_hpc.performance.fitting import model_params

    spec, started = preset["steptime"], time.perf_counter()
    jobs, grids, found, folders, samples = profiled_rounds(device, spec, scratch)
    records, seconds = found["records"], time.perf_counter() - started
    cases = {
        name: step_time_figures([r for r in records if r["case"] == name], model_params(job))
        for name, job in jobs.items()
    }
    for name, job in jobs.items():
        profiles = [r for r in records if r["case"] == name and r["round"] == 0]
        summary, folder = found["trained"][name], Path(folders[name])
        cases[name]["trained"] = epoch_check(job, grids[name], samples[name], profiles, summary, folder)
        kept = keep_whole_run(name, job, samples[name], profiles, summary, cases[name]["trained"], context)
        cases[name]["trained"]["case"] = str(kept)
    median = statistics.median(c["loo"]["median_rel_error"] for c in cases.values())
    judged = [c["trained"]["median_rel_error"] for c in cases.values()]
    epoch = None if None in judged else statistics.median(judged)
    return {
        "description": "step time at N=1 over the batch axis: noise floor of repeated measurements and the "
        "performance model's leave-one-out error (full search), medians over rounds and batches; the train "
        "stage's measured epochs at a profiled batch against the model's predicted epoch; overall: median over cases",
        "loo_median_rel_error": median,
        "epoch_median_rel_error": epoch,
        "noise_floor": statistics.median(c["noise_floor"] for c in cases.values()),
        "seconds": seconds,
        "verdicts": {
            "loo_median": verdict(median, TARGETS["steptime_loo_median"]),
            "trained_epoch_median": verdict(epoch, TARGETS["epoch_time"]),
        },
        "cases": cases,
        "jobs": {name: job.as_dict() for name, job in jobs.items()},
        "measurements": records,
    }


# --- the DAG ---------------------------------------------------------------------------------------


def stage_seconds(log: str) -> dict[str, float]:
    """Each rule's wall time from Snakemake's log: the timestamp before `rule X:` (`localrule`, `checkpoint`,
    `localcheckpoint`) to the one before `Finished jobid: N (Rule: X)`, whole seconds; a rule's jobs add up."""
    started, seconds, stamp, pending = {}, {}, None, None
    for line in log.splitlines():
        if line.startswith("[") and line.endswith("]"):
            try:
                stamp = datetime.strptime(line[1:-1], "%a %b %d %H:%M:%S %Y")
            except ValueError:
                continue
        elif match := re.match(r"(?:local)?(?:rule|checkpoint) (\w+):$", line):
            pending = (match.group(1), stamp)
        elif (match := re.match(r"\s+jobid: (\d+)$", line)) and pending:
            started[match.group(1)], pending = pending, None
        elif (match := re.match(r"Finished jobid: (\d+) \(Rule: (\w+)\)", line)) and match.group(1) in started:
            rule, begun = started.pop(match.group(1))
            seconds[rule] = seconds.get(rule, 0.0) + (stamp - begun).total_seconds()
    return seconds


def import_seconds(logs: Path) -> dict[str, float]:
    """Each stage's imports, from the `python -X importtime` lines (PYTHONPROFILEIMPORTTIME) in its log under `logs`
    (logs/{job}/: the stage's process alone; its workers write elsewhere): the top-level imports' cumulative times
    added up. Issue 39: light stages took 5-6 s on the GPU machine against 1.5-3.8 s here, measured there first."""
    seconds = {}
    for path in sorted(logs.rglob("*.log")):
        top = re.findall(r"^import time:\s+\d+ \|\s+(\d+) \| \S", path.read_text(errors="replace"), re.MULTILINE)
        seconds[str(path.relative_to(logs).with_suffix(""))] = round(sum(map(int, top)) / 1e6, 3)
    return seconds


def run_dag(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, bool]:
    """Snakemake to its end, or stopped (with every stage it started: its own process group) when it still runs
    after `timeout_s`: (its exit status, None where stopped; whether it was stopped). Every process it starts logs
    its imports' times (PYTHONPROFILEIMPORTTIME, read by `import_seconds`)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    with open(log, "w") as output:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            if proc.poll() is not None:  # it ended as the wait gave up: finished work is not cut
                return proc.returncode, False
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            output.write(f"\ngpu-check: stopped after {timeout_s:.0f} s, still running\n")
            return None, True


def dag_section(device: str, preset: dict, scratch: Path, context: dict) -> dict:
    """The default DAG on one device at N = 1, in a scratch folder, through the local profile."""
    import yaml

    from tula_hpc.core.atomic_files import read_json

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
    timeout = min(spec["timeout_s"], max(1.0, context["deadline"] - time.monotonic()))
    started, log = time.perf_counter(), folder / "snakemake.log"
    returncode, stopped = run_dag(cmd, log, timeout)
    wall = time.perf_counter() - started
    results = folder / "results" / DEFAULT_JOB
    found = {}
    for name in ("memory.json", "selection.json", "train/summary.json", "eval.json"):
        if (results / name).exists():
            found[name] = read_json(results / name)
    # Judged by Snakemake's exit and its outputs: a run stopped after its last output was written still finished.
    outputs = "eval.json" in found and (results / "report.md").exists()
    completed = outputs and (returncode == 0 or stopped)
    chosen = found.get("selection.json", {}).get("chosen", {})
    evaluation = found.get("eval.json", {})
    probes = found.get("memory.json", {}).get("probes", [])
    text = log.read_text(errors="replace")
    return {
        "description": "config/jobs.yaml's job on one device, N = 1 only, snakemake --profile profiles/local",
        "command": cmd,
        "changes": job,
        "returncode": returncode,
        "stopped_after_s": timeout if stopped else None,
        "wall_s": wall,
        "stage_seconds": stage_seconds(text),
        "stage_import_seconds": import_seconds(folder / "logs" / DEFAULT_JOB),
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
        "log_tail": None if completed else text[-4000:],
        "verdicts": {
            "completed": {"met": completed, "returncode": returncode},
            "within_90_s": verdict(wall if completed else None, TARGETS["dag_s"]),
        },
    }
