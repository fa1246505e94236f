"""GPU check: the figures only a GPU gives, measured with the workflow's own code, in one file (`make gpu-check`).

Sections, each a function of the device and a size preset (PRESETS) returning its figures and its targets as met
or not, with the figure:
- memory: for each model, image size and precision (fp32, bf16), the probe stage's own probes and fit
  (`memory.run_probes`, `memory.fit_probes`), then the real steady steps of the stage's verification trials
  (`memory.run_in_fresh_process("trial")`, a fresh process each) at batches from twice the largest probe up to
  the largest batch the model gives for the card (its memory less what the allocator cannot have, less the
  headroom; and no tensor of 2^31 elements, `index_cap`), the card itself their budget. Relative error of the
  predicted peak at each batch, median and max, against the allocator's peaks (max_memory_allocated, the
  target's) and its reserved peaks (max_memory_reserved, what sizes the batch).
- oom: the train stage (`train.train`) for a small job whose device budget (resources.device_memory_gb) lies
  between the measured peaks of the selected batch and of its half (OOM_BUDGET_AT of the way), so the first
  attempt runs out of memory for real; the OOM agreement must relaunch it and finish with the global batch
  unchanged.
- steptime: profiles at N = 1 over the whole batch axis (full search) by the profile stage's own measurement
  (`profiling.measure`) in shuffled rounds inside one launched process. As bench/perf_accuracy.py defines
  them: truth(b) is the median of the other rounds' measurements (of their quiet ones when there are any),
  the noise floor the median of |x_r(b) / truth(b) - 1|, and the error of the performance model
  (`performance.fit_profiles`) fitted on one round's other batches (leave-one-out), against the truth.
- dag: the default DAG, config/jobs.yaml's job on one GPU at N = 1, through `snakemake --profile
  profiles/local` in a scratch folder (the repository's results/ untouched): wall time, the chosen
  configuration, the test accuracy.

Without a GPU (and --device auto) it says so, measures nothing, writes nothing and exits 0. `--device cpu
--scale quick --out PATH` runs every section on the CPU at tiny sizes: a test of this check's own code, never
written to bench/results/gpu_check.json. `--sections` runs some sections and keeps the others from an
earlier run of the same code on the same device and scale (a device call runs at most 10 minutes).

Run:  make gpu-check   (the GPU machine has no .venv: scripts/gpu-python.sh, python3 with the wheels of
      `make gpu-wheels`)
      .venv/bin/python bench/gpu_check.py --device cpu --scale quick --out /tmp/gpu_check.json
Writes bench/results/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from common import (
    DEFAULT_JOB,
    JOBS_FILE,
    REPO,
    WORK,
    bench_config,
    bench_job,
    bench_parser,
    files_digest,
    merged,
    provenance,
)

from tula_hpc.files import write_json

SECTIONS = ("memory", "oom", "steptime", "dag")
TARGETS = {"memory_median": 0.03, "memory_max": 0.08, "steptime_loo_median": 0.02}
OOM_BUDGET_AT = 0.6  # the OOM job's budget: this far from the peak at half the batch to the peak at the batch
# Sizes. gpu: what the targets are judged on (digits resized to CIFAR's 32x32; the default job's 8x8 for step
# times). quick: every section at tiny sizes, minutes on two CPU cores.
PRESETS = {
    "gpu": {
        "memory": {
            "cases": [{"model": "tiny_cnn", "image_size": 32}, {"model": "resnet18", "image_size": 32}],
            "precisions": ["fp32", "bf16"],
            "device_memory_gb": "auto",  # the card's own memory
            "batches": 5,
        },
        "oom": {"model": "tiny_cnn", "image_size": 32, "batch": 512, "epochs": 2},
        "steptime": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}, {"model": "resnet18", "image_size": 32}],
            "batch": {"min": 16, "max": 1024},
            "rounds": 3,
            "measurement": {},  # the job's own (config/jobs.yaml)
        },
        "dag": {"changes": {}, "timeout_s": 3000},
    },
    "quick": {
        "memory": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}],
            "precisions": ["fp32"],
            "device_memory_gb": 0.1,
            "batches": 3,
        },
        "oom": {"model": "tiny_cnn", "image_size": 8, "batch": 512, "epochs": 2},
        "steptime": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}],
            "batch": {"min": 16, "max": 64},
            "rounds": 2,
            "measurement": {"warmup_steps": 1, "steps": 2, "min_measure_s": 0.05, "max_attempts": 1},
        },
        "dag": {
            "changes": {
                "train": {"epochs": 2, "lr_milestones": []},
                "search": {
                    "batch": {"min": 64, "max": 128},
                    "warmup_steps": 1,
                    "steps": 2,
                    "min_measure_s": 0.05,
                    "max_attempts": 1,
                },
            },
            "timeout_s": 900,
        },
    },
}
# Source folders and files whose bytes identify the code that measured (the GPU machine's copy has no .git).
SOURCES = ("tula_hpc", "bench", "workflow", "config", "profiles", "Snakefile")


# --- figures and verdicts -----------------------------------------------------------------------------


def verdict(figure: float | None, target: float) -> dict:
    """A target as met or not, with its figure (a figure that could not be measured meets nothing)."""
    figure = None if figure is None else float(figure)
    return {"met": figure is not None and figure <= target, "figure": figure, "target": target}


def error_summary(errors: dict[str, float]) -> dict:
    """Median and largest |relative error| over labelled errors, and the label of the largest."""
    if not errors:
        return {"count": 0, "median_rel_error": None, "max_rel_error": None, "worst": None}
    worst = max(errors, key=lambda label: abs(errors[label]))
    return {
        "count": len(errors),
        "median_rel_error": float(statistics.median(abs(e) for e in errors.values())),
        "max_rel_error": float(abs(errors[worst])),
        "worst": worst,
    }


def spread(low: int, high: int, count: int) -> list[int]:
    """About `count` batches from `low` to `high`, evenly spaced on a log scale (`high` always among them)."""
    if high <= low:
        return [high] if high >= 1 else []
    return sorted({int(round(b)) for b in np.geomspace(low, high, count)})


def all_verdicts(sections: dict) -> dict:
    """Every section's verdicts, as 'section.target'."""
    return {f"{name}.{key}": v for name, s in sections.items() for key, v in s.get("verdicts", {}).items()}


def _gpus(device: str) -> int:
    return 1 if device == "cuda" else 0


def _torch_device(device: str):
    import torch

    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


# --- memory --------------------------------------------------------------------------------------------


def index_cap(job: dict, splits) -> int:
    """The largest batch at which no module's output holds 2^31 elements or more (a forward pass on the meta
    device): beyond, CUDA kernels split the batch or index in 64 bits, which no probe's small batch shows."""
    import torch

    from tula_hpc.models import build_model

    side, largest = job["data"]["image_size"], 0

    def see(_module, _inputs, output) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() // 2)

    with torch.device("meta"):
        model = build_model(job["model"]["name"], splits.num_classes, splits.in_channels, side).eval()
        for module in model.modules():
            module.register_forward_hook(see)
        model(torch.empty(2, splits.in_channels, side, side))
    return (2**31 - 1) // largest


def memory_case(job: dict, batches: int) -> dict:
    """The probe stage's model of one job against its real steady steps at about `batches` batches from twice the
    largest probe up to the card's limit (and `index_cap`)."""
    from tula_hpc import memory
    from tula_hpc.budget import budget_bytes
    from tula_hpc.data import load_splits

    budget = budget_bytes(job, _torch_device("cuda" if job["resources"]["gpus_per_node"] else "cpu"))
    splits = load_splits(job["data"], job["train"]["seed"])
    started = time.perf_counter()
    probes = memory.run_probes(job, len(splits.train), budget)  # as the stage: no probe above the training set
    probe_seconds = time.perf_counter() - started
    ran = memory.measured(probes)
    if len(ran) < 2:
        return {"job": job["name"], "error": "fewer than two probes ran", "probes": probes}
    models = {figure: memory.fit_probes(ran, figure) for figure in memory.PEAK}
    room = memory.room_for_steps(job, budget, probes)
    largest, cap = models[memory.DECIDING_FIGURE].max_batch(room), index_cap(job, splits)
    top = min(largest, cap)
    lowest = 2 * ran[-1]["batch"] if 2 * ran[-1]["batch"] < top else ran[-1]["batch"] + 1
    rows = []
    for batch in spread(lowest, top, batches):
        try:  # the card (or the CPU budget) as the trial's budget: a batch the model puts under the room must fit
            trial = memory.run_in_fresh_process("trial", job=job, batch=batch, budget=budget, ddp=False)
        except RuntimeError as err:  # a crash at one batch is a finding, not the end of the section
            trial = {"outcome": "error", "error": str(err)[-2000:]}
        row = {**trial, "batch": batch}
        for figure, key in memory.PEAK.items():
            predicted, truth = float(models[figure].predict([batch])[0]), trial.get(key)
            error = (predicted - truth) / truth if truth else None
            row[figure] = {"predicted_bytes": round(predicted), "measured_bytes": truth, "rel_error": error}
            print(
                f"  {job['name']} b={batch} {trial['outcome']}: {figure} predicted {predicted / 1e6:.1f} MB, "
                f"measured {(truth or 0) / 1e6:.1f} MB ({'-' if error is None else f'{error:+.2%}'})",
                flush=True,
            )
        rows.append(row)
    return {
        "job": job["name"],
        "model": job["model"]["name"],
        "image_size": job["data"]["image_size"],
        "precision": job["train"]["precision"],
        "budget_bytes": budget,
        "room_bytes": room,
        "deciding_figure": memory.DECIDING_FIGURE,
        "predicted_max_batch": largest,
        "index_cap": cap,
        "probe_batches": [p["batch"] for p in ran],
        "probe_seconds": probe_seconds,
        "departure": {f: m.departure_ for f, m in models.items()},
        "largest_batch_over_largest_probe": top / ran[-1]["batch"],
        "trials": rows,
        "not_fitting": [f"b={r['batch']} {r['outcome']}" for r in rows if r["outcome"] != "fits"],
        "errors": {
            f: error_summary({str(r["batch"]): r[f]["rel_error"] for r in rows if r["outcome"] == "fits"})
            for f in memory.PEAK
        },
    }


def memory_section(device: str, preset: dict) -> dict:
    from tula_hpc.memory import PEAK

    spec = preset["memory"]
    cases = []
    for case in spec["cases"]:
        for precision in spec["precisions"]:
            name = f"gpu-check-{case['model']}-{case['image_size']}-{precision}"
            try:
                job = bench_job(
                    as_name=name,
                    model={"name": case["model"]},
                    data={"name": "digits", "image_size": case["image_size"]},
                    train={"precision": precision},
                    resources={"gpus_per_node": _gpus(device), "device_memory_gb": spec["device_memory_gb"]},
                )
                cases.append(memory_case(job, spec["batches"]))
            except Exception:  # one case's crash leaves the others' figures
                cases.append({"job": name, "error": traceback.format_exc()[-4000:]})
    ran = [c for c in cases if "error" not in c]
    overall = {
        f: error_summary(
            {
                f"{c['job']} b={r['batch']}": r[f]["rel_error"]
                for c in ran
                for r in c["trials"]
                if r["outcome"] == "fits"
            }
        )
        for f in PEAK
    }
    failed = [f"{c['job']} {trial}" for c in ran for trial in c["not_fitting"]]
    verdicts = {}
    for figure, summary in overall.items():
        suffix = "" if figure == "allocated" else f"_{figure}"
        verdicts[f"median{suffix}"] = verdict(summary["median_rel_error"], TARGETS["memory_median"])
        # A batch the model put under the card that did not run, or a case that did not, is an error beyond any target.
        worst = summary["max_rel_error"] if not failed and len(ran) == len(cases) else None
        verdicts[f"max{suffix}"] = verdict(worst, TARGETS["memory_max"])
    return {
        "description": "relative error of the memory model's predicted peak against the real steady steps' peaks, "
        "per figure (allocated: max_memory_allocated, the target's; reserved: max_memory_reserved)",
        "overall": overall,
        "not_fitting": failed,
        "failed_cases": [c["job"] for c in cases if "error" in c],
        "verdicts": verdicts,
        "cases": cases,
    }


# --- out of memory in training ------------------------------------------------------------------------


def oom_section(device: str, preset: dict, scratch: Path) -> dict:
    """The train stage under a budget its selected batch does not fit (a real out-of-memory error) but half does."""
    from tula_hpc import memory
    from tula_hpc.budget import GB, budget_bytes
    from tula_hpc.files import read_json
    from tula_hpc.train import train

    spec = preset["oom"]
    batch, key = spec["batch"], memory.PEAK[memory.DECIDING_FIGURE]  # the figure the device's cap applies to
    changes = {
        "model": {"name": spec["model"]},
        "data": {"name": "digits", "image_size": spec["image_size"]},
        "train": {"epochs": spec["epochs"], "lr_milestones": []},
        "resources": {"gpus_per_node": _gpus(device), "device_memory_gb": "auto"},
    }
    roomy = bench_job(as_name="gpu-check-oom", **changes)
    card = budget_bytes(roomy, _torch_device(device))
    steps = {
        b: memory.run_in_fresh_process("trial", job=roomy, batch=b, budget=card, ddp=False) for b in (batch // 2, batch)
    }
    if any(s["outcome"] != "fits" for s in steps.values()):
        return {"error": "the steps do not fit the card at the OOM job's batch", "trials": steps}
    peaks = {b: s[key] for b, s in steps.items()}
    budget = int(peaks[batch // 2] + OOM_BUDGET_AT * (peaks[batch] - peaks[batch // 2]))
    changes["resources"]["device_memory_gb"] = budget / GB
    job = bench_job(as_name="gpu-check-oom", **changes)
    folder = scratch / "oom"
    write_json(folder / "selection.json", {"chosen": {"nodes": 1, "batch": batch, "per_device_batch": batch}})
    started = time.perf_counter()
    try:
        summary = train(job, folder / "selection.json", folder / "summary.json", folder / "model.pt", folder / "work")
    except Exception as err:  # the stage's own failure is this section's finding; its attempts log says how far
        log = folder / "work" / "train" / "attempts.json"
        summary = {"error": f"{type(err).__name__}: {str(err)[-3000:]}", "attempts": []}
        summary["attempts"] = read_json(log)["attempts"] if log.exists() else []
    attempts = summary["attempts"]
    checks = {
        "relaunched": len(attempts) >= 2 and attempts[0]["outcome"] == "out_of_memory",
        "global_batch_unchanged": bool(attempts)
        and all(a["global_batch"] == batch for a in attempts)
        and summary.get("global_batch") == batch,
        "completed": bool(attempts)
        and attempts[-1]["outcome"] == "completed"
        and len(summary.get("history", [])) == spec["epochs"],
    }
    return {
        "description": f"train stage at global batch {batch} under a budget {OOM_BUDGET_AT} of the way from the "
        f"peak at {batch // 2} to the peak at {batch} ({key})",
        "job": job,
        "peaks_bytes": {str(b): peak for b, peak in peaks.items()},
        "budget_bytes": budget,
        "seconds": time.perf_counter() - started,
        "attempts": attempts,
        "summary": {k: v for k, v in summary.items() if k not in ("history", "attempts")},
        "epochs_trained": len(summary.get("history", [])),
        "checks": checks,
        "verdicts": {"relaunch_keeps_global_batch": {"met": all(checks.values()), **checks}},
    }


# --- step time --------------------------------------------------------------------------------------


def steps_worker(jobs: dict, schedule: list[dict]) -> list[dict]:
    """In a launched process: `profiling.measure` at each scheduled (job, per-device batch), one rank."""
    from tula_hpc.distributed import init_distributed, shutdown
    from tula_hpc.profiling import measure

    job = next(iter(jobs.values()))
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
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


def steptime_section(device: str, preset: dict, scratch: Path) -> dict:
    from tula_hpc import launch
    from tula_hpc.data import load_splits
    from tula_hpc.performance import model_params
    from tula_hpc.plan import candidate_grid

    spec = preset["steptime"]
    jobs = {
        f"{case['model']}-{case['image_size']}": bench_job(
            as_name=f"gpu-check-steps-{case['model']}-{case['image_size']}",
            model={"name": case["model"]},
            data={"name": "digits", "image_size": case["image_size"]},
            resources={"gpus_per_node": _gpus(device)},
            search={**spec["measurement"], "mode": "full", "nodes": {"min": 1, "max": 1}, "batch": spec["batch"]},
        )
        for case in spec["cases"]
    }
    first = next(iter(jobs.values()))
    train_samples = len(load_splits(first["data"], first["train"]["seed"]).train)
    grids = {name: candidate_grid(job["search"], 1, spec["batch"]["max"], train_samples) for name, job in jobs.items()}
    rng, schedule = random.Random(0), []
    for n in range(spec["rounds"]):
        order = [
            {"round": n, "case": name, "per_device_batch": c["per_device_batch"]}
            for name, g in grids.items()
            for c in g
        ]
        rng.shuffle(order)
        schedule += order
    started = time.perf_counter()
    records = launch.run(
        steps_worker,
        dict(jobs=jobs, schedule=schedule),
        launch.LaunchSpec.for_job(first, nodes=1),
        scratch / "steptime",
        name="gpu-check-steptime",
    )
    cases = {
        name: step_time_figures([r for r in records if r["case"] == name], model_params(job))
        for name, job in jobs.items()
    }
    median = statistics.median(c["loo"]["median_rel_error"] for c in cases.values())
    return {
        "description": "step time at N=1 over the batch axis: noise floor of repeated measurements and the "
        "performance model's leave-one-out error (full search), medians over rounds and batches; overall: "
        "median over cases",
        "loo_median_rel_error": median,
        "noise_floor": statistics.median(c["noise_floor"] for c in cases.values()),
        "measure_seconds": time.perf_counter() - started,
        "verdicts": {"loo_median": verdict(median, TARGETS["steptime_loo_median"])},
        "cases": cases,
        "jobs": jobs,
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
        {"resources": {"gpus_per_node": _gpus(device)}, "search": {"nodes": {"min": 1, "max": 1}}}, spec["changes"]
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


# --- the result file ----------------------------------------------------------------------------------


def provenance_here() -> dict:
    """common.provenance, or where the tree has no .git (the GPU machine's copy) the same without git: the
    commit from TULA_GIT_COMMIT if the caller set it. The source digest identifies the code either way."""
    try:
        found = provenance()
    except (OSError, subprocess.CalledProcessError):
        import platform
        from importlib.metadata import version

        import common

        found = {
            "git_commit": os.environ.get("TULA_GIT_COMMIT"),
            "git_dirty": None,
            "processor": common._processor(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": version("torch"),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    return {**found, "source_digest": files_digest(list(SOURCES))}


def device_info(device: str) -> dict:
    import torch

    info = {"type": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=torch.cuda.get_device_name(0), memory_bytes=props.total_memory, cudnn=torch.backends.cudnn.version()
        )
    else:
        import common

        info["name"] = common._processor()
    return info


def kept_sections(path: Path, device: dict, scale: str, digest: str, rerun: list[str]) -> dict:
    """Sections of an earlier result file to keep: same code, device and scale, and not run again now."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    same = (
        earlier.get("device", {}).get("name") == device["name"]
        and earlier.get("settings", {}).get("scale") == scale
        and earlier.get("provenance", {}).get("source_digest") == digest
    )
    if not same:
        print(f"{path}: written by other code, device or scale: its sections are not kept", flush=True)
        return {}
    return {name: s for name, s in earlier.get("sections", {}).items() if name not in rerun}


def run_section(name: str, device: str, preset: dict, scratch: Path) -> dict:
    started = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        if name == "memory":
            result = memory_section(device, preset)
        elif name == "oom":
            result = oom_section(device, preset, scratch)
        elif name == "steptime":
            result = steptime_section(device, preset, scratch)
        else:
            result = dag_section(device, preset, scratch)
    except Exception:
        result = {"error": traceback.format_exc()[-6000:], "verdicts": {"ran": {"met": False}}}
        print(result["error"], file=sys.stderr, flush=True)
    result["section_seconds"] = time.perf_counter() - started
    print(f"== {name}: {result['section_seconds']:.0f} s", flush=True)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def report(verdicts: dict) -> None:
    for name, v in verdicts.items():
        figure = v.get("figure")
        shown = f" {figure:.2%} (target {v['target']:.0%})" if isinstance(figure, float) else ""
        print(f"{name:40s} {'met' if v['met'] else 'NOT MET'}{shown}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "gpu_check.json")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: the GPU if any")
    parser.add_argument("--scale", choices=sorted(PRESETS), help="sizes (default: gpu on CUDA, quick on the CPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--work-dir", type=Path, default=WORK / "gpu_check", help="scratch (default %(default)s)")
    args = parser.parse_args(argv)

    import torch

    if args.device == "auto" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU found (torch {torch.__version__}: torch.cuda.is_available() is False); "
            f"nothing was measured and {args.out} was not written."
        )
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    device = "cuda" if args.device == "auto" else args.device
    if device == "cpu" and args.out.resolve() == parser.get_default("out").resolve():
        parser.error(f"--device cpu tests the check itself: name its file with --out (never {args.out})")
    scale = args.scale or ("gpu" if device == "cuda" else "quick")
    info, found = device_info(device), provenance_here()
    sections = kept_sections(args.out, info, scale, found["source_digest"], args.sections)
    scratch = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    print(
        f"gpu-check on {info['name']} ({device}, torch {info['torch']}), scale {scale}; scratch {scratch}", flush=True
    )
    for name in args.sections:
        sections[name] = run_section(name, device, PRESETS[scale], scratch)
        verdicts = all_verdicts({n: sections[n] for n in SECTIONS if n in sections})
        document = {
            "provenance": found,
            "device": info,
            "settings": {"scale": scale, "preset": PRESETS[scale], "targets": TARGETS, "oom_budget_at": OOM_BUDGET_AT},
            "targets_judged": device == "cuda" and scale == "gpu",
            "verdicts": verdicts,
            "all_met": all(v["met"] for v in verdicts.values()),
            "sections": {n: sections[n] for n in SECTIONS if n in sections},
        }
        write_json(args.out, document)
    print(f"wrote {args.out}", flush=True)
    report(document["verdicts"])
    return 1 if any("error" in s for s in sections.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
