"""The GPU check's memory sections (bench/gpu_check.py runs them): the memory model against real steps, the
batch the memory stage proposes trained for real, and the train stage's relaunch after running out of memory.

Each section is a function of the device ("cuda" or "cpu") and the size preset (gpu_check.PRESETS), and a
scratch folder where it needs one; it returns its figures and its verdicts.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path

import cloudpickle
import numpy as np
from common import bench_job, error_summary, verdict

from tula_hpc.job import Job

# A launched process cannot import bench/'s modules: its worker (train_peak_worker) travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
TARGETS = {"memory_median": 0.03, "memory_max": 0.08}
OOM_BUDGET_AT = 0.6  # the OOM job's budget: this far from the peak at half the batch to the peak at the batch
ABOVE_PROPOSED = 1.05  # the training section's second batch: this much above the proposed one


def gpus(device: str) -> int:
    return 1 if device == "cuda" else 0


def torch_device(device: str):
    import torch

    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def spread(low: int, high: int, count: int) -> list[int]:
    """About `count` batches from `low` to `high`, evenly spaced on a log scale (`high` always among them)."""
    if high <= low:
        return [high] if high >= 1 else []
    return sorted({int(round(b)) for b in np.geomspace(low, high, count)})


def case_job(device: str, case: dict, name: str, **sections) -> Job:
    """The bench job of one case (model, image size, precision) on digits, on `device`."""
    resources = {"gpus_per_node": gpus(device), **sections.pop("resources", {})}
    # One node: the GPU machine has one GPU, and two NCCL ranks cannot share it (validation refuses more).
    sections["search"] = {"nodes": {"min": 1, "max": 1}, **sections.get("search", {})}
    return bench_job(
        as_name=name,
        model={"name": case["model"]},
        data={"name": "digits", "image_size": case["image_size"]},
        train={"precision": case.get("precision", "fp32"), **sections.pop("train", {})},
        resources=resources,
        **sections,
    )


# --- memory: the model against real steps --------------------------------------------------------------


def index_cap(job: Job, splits) -> int:
    """tula_hpc.models.index_cap of the job's model for its data (`splits`' classes and channels)."""
    from tula_hpc import models

    return models.index_cap(
        job.model.name, splits.num_classes, splits.in_channels, job.data.image_size, job.model.kwargs
    )


def compared(models: dict, batch: int, measured: dict, buckets: int = 0) -> dict:
    """Each figure's predicted peak at `batch` (plus DDP's buckets) against the measured one, where measured."""
    from tula_hpc import memory_model

    rows = {}
    for figure, key in memory_model.PEAK.items():
        predicted, truth = float(models[figure].predict([batch])[0]) + buckets, measured.get(key)
        error = (predicted - truth) / truth if truth else None
        rows[figure] = {"predicted_bytes": round(predicted), "measured_bytes": truth, "rel_error": error}
        shown = "-" if error is None else f"{error:+.2%}"
        print(
            f"  b={batch}: {figure} predicted {predicted / 1e6:.1f} MB, measured {(truth or 0) / 1e6:.1f} MB ({shown})"
        )
    return rows


def memory_trials(job: Job, models: dict, batches: list[int], budget: int) -> list[dict]:
    """The stage's verification trial (steady steps in a fresh process) at each batch, the card as its budget."""
    from tula_hpc import memory_probes

    rows = []
    for batch in batches:
        try:  # a batch the model puts under the room must fit
            trial = memory_probes.run_in_fresh_process("trial", job=job, batch=batch, budget=budget, ddp=False)
        except RuntimeError as err:  # a crash at one batch is a finding, not the end of the section
            trial = {"outcome": "error", "error": str(err)[-2000:]}
        print(f"  {job.name} b={batch}: {trial['outcome']}", flush=True)
        rows.append({**trial, "batch": batch, **compared(models, batch, trial)})
    return rows


def memory_case(job: Job, batches: int) -> dict:
    """The probe stage's model of one job against its real steady steps at about `batches` batches from twice the
    largest probe up to the card's limit (and `index_cap`)."""
    from tula_hpc import memory_model, probe_memory
    from tula_hpc.budget import budget_bytes
    from tula_hpc.data import load_splits

    budget = budget_bytes(job, torch_device("cuda" if job.resources.gpus_per_node else "cpu"))
    splits = load_splits(job.data, job.train.seed)
    started = time.perf_counter()
    probes = probe_memory.run_probes(job, len(splits.train), budget)  # as the stage: no probe above the training set
    probe_seconds = time.perf_counter() - started
    ran = memory_model.measured(probes)
    if len(ran) < 2:
        return {"job": job.name, "error": "fewer than two probes ran", "probes": probes}
    models = {figure: memory_model.fit_probes(ran, figure) for figure in memory_model.PEAK}
    room = memory_model.room_for_steps(job, budget, probes)
    largest, cap = models[memory_model.DECIDING_FIGURE].max_batch(room), index_cap(job, splits)
    top = min(largest, cap)
    lowest = 2 * ran[-1]["batch"] if 2 * ran[-1]["batch"] < top else ran[-1]["batch"] + 1
    rows = memory_trials(job, models, spread(lowest, top, batches), budget)
    return {
        "job": job.name,
        "model": job.model.name,
        "image_size": job.data.image_size,
        "precision": job.train.precision,
        "budget_bytes": budget,
        "room_bytes": room,
        "deciding_figure": memory_model.DECIDING_FIGURE,
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
            for f in memory_model.PEAK
        },
    }


def memory_section(device: str, preset: dict, scratch: Path) -> dict:
    from tula_hpc.memory_model import PEAK

    spec = preset["memory"]
    cases = []
    for case in spec["cases"]:
        for precision in spec["precisions"]:
            name = f"gpu-check-{case['model']}-{case['image_size']}-{precision}"
            try:
                resources = {"device_memory_gb": spec["device_memory_gb"]}
                job = case_job(device, {**case, "precision": precision}, name, resources=resources)
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


# --- training: the proposed batch trained for real ----------------------------------------------------


def train_peak_worker(job: Job, global_batch: int, run_dir: str) -> dict:
    """In a launched process: the train stage's own worker at `global_batch` (at N = 1, as the stage runs it: one
    rank, no process group, no DDP wrapper), then the device's peaks over the whole run. Running out of memory is
    an answer here, not a crash."""
    from tula_hpc import memory_model
    from tula_hpc.budget import DeviceBudgetError, device_memory, is_out_of_memory
    from tula_hpc.distributed import init_distributed
    from tula_hpc.train import train_worker

    device = init_distributed(job.resources.gpus_per_node > 0).device
    files = {name: str(Path(run_dir) / name) for name in ("checkpoint.pt", "model.pt", "metrics.jsonl")}
    try:
        summary = train_worker(job, global_batch, *files.values())
        found = {"outcome": "completed", "steps": summary["steps"], "train_time_s": summary["train_time_s"]}
    except DeviceBudgetError as err:
        return {"outcome": "budget_too_small", "error": str(err)}
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        return {
            "outcome": "out_of_memory",
            "failed_at_bytes": device_memory.failed_at(device, err),
            "error": str(err)[:500],
        }
    return {**found, **{key: device_memory.peak(device, figure) for figure, key in memory_model.PEAK.items()}}


def trained(job: Job, batch: int, folder: Path) -> dict:
    """`train_peak_worker` launched as the train stage launches its worker."""
    from tula_hpc import launch

    folder.mkdir(parents=True, exist_ok=True)
    return launch.run(
        train_peak_worker,
        dict(job=job, global_batch=batch, run_dir=str(folder)),
        launch.LaunchSpec.for_job(job, nodes=1),
        folder,
        name=f"{job.name}-b{batch}",
    )


def memory_limited_budget(job: Job, proposal: dict) -> float:
    """A budget (GB) under which the memory model's largest batch is half the training set: a proposal that the
    training set caps says nothing about memory, and digits' training set is small next to a card. The budget
    limits the device (budget.device_memory) in the stage and in training alike, so it stands in for a card."""
    from tula_hpc.budget import GB

    fit, half = proposal["fit"], proposal["dataset"]["train"] // 2
    need = fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * half
    return need / (1 - job.resources.memory_headroom) / GB


def training_case(job_at, budget_gb, folder: Path) -> dict:
    """The memory stage itself (probes, fit, verification trials with their correction) for the job `job_at` gives
    at a budget, then the train stage's worker at the batch it proposes and ABOVE_PROPOSED times it."""
    from tula_hpc import memory_model, probe_memory
    from tula_hpc.budget import budget_source

    def above(proposal: dict) -> int:
        return max(proposal["max_batch_per_device"] + 1, math.ceil(proposal["max_batch_per_device"] * ABOVE_PROPOSED))

    job = job_at(budget_gb)
    proposal = probe_memory.probe_memory(job, folder / "memory.json", folder / "card")
    budget_note = budget_source(job)
    if above(proposal) > proposal["dataset"]["train"]:  # no batch above the proposal would be trained
        job = job_at(memory_limited_budget(job, proposal))
        budget_note += f" leaves no batch above the proposal; again at {job.resources.device_memory_gb:.4f} GB"
        proposal = probe_memory.probe_memory(job, folder / "memory.json", folder / "limited")
    ran = memory_model.measured(proposal["probes"])
    models = {figure: memory_model.fit_probes(ran, figure) for figure in memory_model.PEAK}
    rows = []
    for batch in (proposal["max_batch_per_device"], above(proposal)):
        run = trained(job, batch, folder / f"b{batch}")
        print(f"  {job.name} trained at b={batch}: {run['outcome']}", flush=True)
        rows.append({"batch": batch, **run, **compared(models, batch, run, proposal["ddp_bucket_bytes"])})
    return {
        "job": job.name,
        "budget": budget_note,
        "budget_bytes": proposal["device_memory_bytes"],
        "usable_bytes": proposal["usable_bytes"],
        "train_samples": proposal["dataset"]["train"],
        "proposal": {k: proposal[k] for k in ("predicted_max_batch", "max_batch_per_device", "verified", "limited_by")},
        "verification": proposal["verification"],
        "proposed": rows[0],
        "above": rows[1],
    }


def training_section(device: str, preset: dict, scratch: Path) -> dict:
    """The largest batch the memory stage proposes, trained for real by the train stage's worker, and 5 % above."""
    spec, cases = preset["training"], []
    changes = {"train": {"epochs": spec["epochs"], "lr_milestones": []}, "search": {"nodes": {"min": 1, "max": 1}}}
    for case in spec["cases"]:
        name = f"gpu-check-train-{case['model']}-{case['image_size']}-{case['precision']}"

        def job_at(budget_gb, case=case, name=name) -> Job:
            return case_job(device, case, name, resources={"device_memory_gb": budget_gb}, **changes)

        try:
            cases.append(training_case(job_at, spec["device_memory_gb"], scratch / "training" / name))
        except Exception:  # one case's crash leaves the others' figures
            cases.append({"job": name, "error": traceback.format_exc()[-4000:]})
    ran = [c for c in cases if "error" not in c]
    proposed_errors = {c["job"]: c["proposed"]["reserved"]["rel_error"] for c in ran}
    verdicts = {
        "proposed_trains": {
            "met": len(ran) == len(cases) and all(c["proposed"]["outcome"] == "completed" for c in ran),
            **{c["job"]: c["proposed"]["outcome"] for c in ran},
        },
        # Above the proposal the headroom may hold it or not: either is the model working; anything else is not.
        "above_trains_or_runs_out": {
            "met": len(ran) == len(cases) and all(c["above"]["outcome"] in ("completed", "out_of_memory") for c in ran),
            **{c["job"]: c["above"]["outcome"] for c in ran},
        },
        "proposed_peak_reserved": verdict(
            error_summary(proposed_errors)["max_rel_error"] if len(ran) == len(cases) else None, TARGETS["memory_max"]
        ),
    }
    return {
        "description": f"the memory stage's proposed per-device batch trained by train.train_worker ({spec['epochs']} "
        f"epoch(s), N = 1), and {ABOVE_PROPOSED:.2f} x it: outcome, and each figure's predicted peak against the "
        "run's measured peak",
        "verdicts": verdicts,
        "failed_cases": [c["job"] for c in cases if "error" in c],
        "cases": cases,
    }


# --- out of memory in training ------------------------------------------------------------------------


def oom_section(device: str, preset: dict, scratch: Path) -> dict:
    """The train stage under a budget its selected batch does not fit (a real out-of-memory error) but half does."""
    from tula_hpc import memory_model, memory_probes
    from tula_hpc.budget import GB, budget_bytes
    from tula_hpc.files import read_json
    from tula_hpc.records import Selection
    from tula_hpc.train import train

    spec = preset["oom"]
    batch, key = (
        spec["batch"],
        memory_model.PEAK[memory_model.DECIDING_FIGURE],
    )  # the figure the device's cap applies to
    changes = {"train": {"epochs": spec["epochs"], "lr_milestones": []}}
    roomy = case_job(device, spec, "gpu-check-oom", resources={"device_memory_gb": "auto"}, **changes)
    card = budget_bytes(roomy, torch_device(device))
    steps = {
        b: memory_probes.run_in_fresh_process("trial", job=roomy, batch=b, budget=card, ddp=False)
        for b in (batch // 2, batch)
    }
    if any(s["outcome"] != "fits" for s in steps.values()):
        return {"error": "the steps do not fit the card at the OOM job's batch", "trials": steps}
    peaks = {b: s[key] for b, s in steps.items()}
    budget = int(peaks[batch // 2] + OOM_BUDGET_AT * (peaks[batch] - peaks[batch // 2]))
    job = case_job(device, spec, "gpu-check-oom", resources={"device_memory_gb": budget / GB}, **changes)
    folder = scratch / "oom"
    Selection.by_hand(job, {"nodes": 1, "batch": batch, "per_device_batch": batch}).write(folder / "selection.json")
    started = time.perf_counter()
    try:
        summary = train(job, folder / "selection.json", folder / "summary.json", folder / "model.pt", folder / "work")
        summary = summary.as_dict()
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
        "job": job.as_dict(),
        "peaks_bytes": {str(b): peak for b, peak in peaks.items()},
        "budget_bytes": budget,
        "seconds": time.perf_counter() - started,
        "attempts": attempts,
        "summary": {k: v for k, v in summary.items() if k not in ("history", "attempts")},
        "epochs_trained": len(summary.get("history", [])),
        "checks": checks,
        "verdicts": {"relaunch_keeps_global_batch": {"met": all(checks.values()), **checks}},
    }
