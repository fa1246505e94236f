"""The GPU check's memory sections (bench/gpu_check.py runs them): the truth of the largest batch for each case, the
probe stage's time to it (one process and fresh processes) beside PyTorch Lightning's, and the train stage's relaunch
after a real out-of-memory error.

Each section is a function of the device ("cuda" or "cpu"), the size preset (gpu_plan.PRESETS), a scratch folder and
the run's context (its stamp, where case files go, its deadline); it returns its figures and its verdicts.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from tula_bench.common import bench_job, error_summary, new_case_path, verdict
from tula_bench.gpu_plan import STEPS_PER_EPOCH
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.job import Job

TARGETS = {"memory_median": 0.03, "memory_max": 0.08, "truth_bracket": 0.01, "stage_vs_truth": 0.02}
TARGETS |= {"stage_over_lightning": 0.5, "both_ways": 0.02}
OOM_BUDGET_AT = 0.6  # the OOM job's budget starts this far from the allocated peak at half the batch to the batch's
OOM_BUDGET_MOVES = 6  # tries at placing that budget so the batch fails and half of it fits


def gpus(device: str) -> int:
    return 1 if device == "cuda" else 0


def torch_device(device: str):
    import torch

    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def synthetic_size(batch: int, steps: int = STEPS_PER_EPOCH, val: float = 0.1, test: float = 0.2) -> int:
    """A synthetic data set whose training split gives `steps` steps an epoch at `batch` (val and test held out)."""
    return math.ceil(steps * batch / (1 - val - test)) + 3


def workload_job(device: str, case: dict, name: str, batch: int, **sections) -> Job:
    """The bench job of a workload (model, image size, precision, memory format, classes, cores) on synthetic data of
    its shape sized for STEPS_PER_EPOCH steps an epoch at `batch` (or the case's steps_per_epoch: the CPU's quick
    test), one node on `device` and its whole memory."""
    steps = case.get("steps_per_epoch", STEPS_PER_EPOCH)
    data = {"channels": 3, "classes": case.get("classes", 10), "size": synthetic_size(batch, steps)}
    train = {"precision": case["precision"], "channels_last": case.get("channels_last", False)}
    return bench_job(
        as_name=name,
        model={"name": case["model"]},
        data={"name": "synthetic", "image_size": case["image_size"], "kwargs": data},
        train={**train, **sections.pop("train", {})},
        resources={
            "gpus_per_node": gpus(device),
            "device_memory_gb": "auto",  # the card (the jobs file's 1 GB would cap a GPU)
            "cpus_per_task": case.get("cpus_per_task", 1),  # its loader's workers: one fewer
            **sections.pop("resources", {}),
        },
        search={"nodes": {"min": 1, "max": 1}, **sections.pop("search", {})},
        **sections,
    )


def compared(models: dict, batch: int, measured: dict) -> dict:
    """Each figure's predicted peak at `batch` against the measured one, where measured."""
    from tula_hpc.memory.step_parts import PEAK

    rows = {}
    for figure, key in PEAK.items():
        predicted, truth = float(models[figure].predict([batch])[0]), measured.get(key)
        error = (predicted - truth) / truth if truth else None
        rows[figure] = {"predicted_bytes": round(predicted), "measured_bytes": truth, "rel_error": error}
    return rows


# --- memory: the largest batch's truth, the stage's answer and its time, Lightning's ---------------------------


def stage_run(job: Job, way: str) -> dict:
    """The probe stage's worker and summary (`memory_worker.probe_worker`, `memory_summary.summarise`) here, its
    probes and trials run `way` (resources.memory_probes_in): its answer and its seconds."""
    from tula_hpc.memory.device_budget import device_memory
    from tula_hpc.profiling.memory_probes import probe_device
    from tula_hpc.profiling.memory_summary import summarise
    from tula_hpc.profiling.memory_worker import probe_worker

    job = job.updated(resources={"memory_probes_in": way})
    device = probe_device(job)
    held = device_memory.in_use(device) if device.type == "cuda" else None  # this process's, not the stage's
    started = time.perf_counter()
    try:
        result = summarise(job, probe_worker(job))
    except Exception as err:  # the stage failing is a finding of this case, not the end of it
        return {
            "way": way,
            "error": f"{type(err).__name__}: {str(err)[-2000:]}",
            "seconds": time.perf_counter() - started,
        }
    finally:
        device_memory.release(device)
    seconds = time.perf_counter() - started
    print(f"  stage ({way}): {result['max_batch_per_device']} in {seconds:.1f} s", flush=True)
    return {
        "way": way,
        "seconds": seconds,
        "answer": result["max_batch_per_device"],
        "limit": result["limit"],
        "verified": result["verified"],
        "probes": [p["batch"] for p in result["probes"]],
        "trials": [{"batch": t["batch"], "outcome": t["outcome"]} for t in result["verification"]],
        "this_process_held_bytes": held,
    }


def model_errors(record: dict) -> dict:
    """Each figure's model (fitted to the case's probes) against the peaks of every bisection trial that fit."""
    from tula_hpc.memory import model as memory_model
    from tula_hpc.memory.step_parts import PEAK

    ran = memory_model.measured(record["memory"]["probes"])
    models = {figure: memory_model.fit_probes(ran, figure) for figure in PEAK}
    rows = {f"b={t['batch']}": compared(models, t["batch"], t) for t in record["trials"] if t["outcome"] == "fits"}
    found = {}
    for figure in PEAK:
        errors = {label: row[figure]["rel_error"] for label, row in rows.items()}
        found[figure] = {"per_trial": errors, **error_summary(errors)}
    return found


def stage_vs_truth(stage: dict, truth: dict) -> float | None:
    """How far the stage's answer lies below the largest batch seen to fit (None: none fit, or the answer failed)."""
    fits, fails = truth["largest_fits"], truth["smallest_fails"]
    if not fits or "answer" not in stage or (fails is not None and stage["answer"] >= fails):
        return None
    return abs(fits - stage["answer"]) / fits


def memory_case(name: str, case: dict, device: str, spec: dict, scratch: Path, context: dict) -> dict:
    """The truth (bench/gpu_truth.py's probes and bisection in this process), Lightning's search and the stage timed
    each way the case asks, on the same job; written as a replay case."""
    from tula_bench import gpu_lightning, gpu_truth
    from tula_hpc.memory.device_budget import device_memory
    from tula_hpc.profiling.memory_probes import probe_device

    record = gpu_truth.run_case(name, case, device, spec["device_memory_gb"], context["deadline"], context["recorded"])
    path = new_case_path(context["cases_dir"], record["recorded"]["device"]["name"], name)
    write_json(path, record)  # the truth kept whatever follows; the same file completed below
    job = Job.from_dict(record["job"])
    device_memory.release(probe_device(job))
    if case.get("lightning"):
        found = record["lightning"] = gpu_lightning.search(job, spec["lightning"], scratch / "lightning" / name)
        device_memory.release(probe_device(job))
        print(f"  lightning: {found.get('skipped') or found.get('error') or found['answer']}", flush=True)
    record["stage"] = {way: stage_run(job, way) for way in case.get("stage", [])}
    record["model_errors"] = model_errors(record)
    write_json(path, record)
    print(f"  truth {record['truth']['largest_fits']}..{record['truth']['smallest_fails']}; wrote {path}", flush=True)
    return {"case_file": str(path), **record}


def memory_verdicts(cases: list[dict], failed: list[dict]) -> dict:
    """The section's targets over its cases; a case that crashed leaves every target it bears on unmet, and a
    comparison a case does not make (Lightning absent, no stage timed) is left out rather than failed."""
    from tula_hpc.memory.step_parts import PEAK

    every = not failed
    verdicts = {}
    for figure in PEAK:
        errors = {f"{c['case']} {b}": e for c in cases for b, e in c["model_errors"][figure]["per_trial"].items()}
        summary, suffix = error_summary(errors), "" if figure == "allocated" else f"_{figure}"
        verdicts[f"median{suffix}"] = verdict(summary["median_rel_error"], TARGETS["memory_median"])
        verdicts[f"max{suffix}"] = verdict(summary["max_rel_error"] if every else None, TARGETS["memory_max"])
    brackets = [c["truth"]["bracketed_within"] for c in cases]
    verdicts["truth_bracketed"] = verdict(
        max(brackets) if every and cases and None not in brackets else None, TARGETS["truth_bracket"]
    )
    timed = [c for c in cases if "one_process" in c["stage"]]
    if timed or failed:  # a section whose cases time no stage judges none
        gaps = [stage_vs_truth(c["stage"]["one_process"], c["truth"]) for c in timed]
        worst = max(gaps) if timed and None not in gaps and every else None
        verdicts["stage_vs_truth"] = verdict(worst, TARGETS["stage_vs_truth"])
    raced = [c for c in timed if c.get("lightning", {}).get("answer")]
    if raced:  # Lightning absent: its comparison is skipped, not failed
        answered = all("answer" in c["stage"]["one_process"] for c in raced)
        ratio = answered and max(c["stage"]["one_process"]["seconds"] / c["lightning"]["seconds"] for c in raced)
        verdicts["stage_time_over_lightning"] = verdict(ratio if answered else None, TARGETS["stage_over_lightning"])
    both = [c["stage"] for c in cases if set(c["stage"]) >= {"one_process", "fresh_processes"}]
    if both:
        answered = all("answer" in s[way] for s in both for way in ("one_process", "fresh_processes"))
        apart = answered and max(abs(s["one_process"]["answer"] / s["fresh_processes"]["answer"] - 1) for s in both)
        verdicts["both_ways_agree"] = verdict(apart if answered else None, TARGETS["both_ways"])
    return verdicts


def memory_section(device: str, preset: dict, scratch: Path, context: dict, key: str = "memory") -> dict:
    """The cases of preset[`key`]: the memory section's own (CIFAR's shape) or memory_imagenet's."""
    import traceback

    spec, cases, failed = preset[key], [], []
    for name, case in spec["cases"].items():
        try:
            cases.append(memory_case(name, case, device, spec, scratch, context))
        except Exception:  # one case's crash leaves the others' figures
            failed.append({"case": name, "error": traceback.format_exc()[-4000:]})
            print(failed[-1]["error"], flush=True)
    return {
        "description": "for each case, in one process: the probe stage's probes, then a bisection of the card's "
        "largest batch with real steady steps (bench/gpu_truth.py); Lightning's BatchSizeFinder (binsearch, margin 0) "
        "on the same model; the probe stage (probe_worker + summarise) timed in one process and in fresh processes; "
        "each figure's model against the bisection's fitting trials",
        "verdicts": memory_verdicts(cases, failed),
        "failed_cases": failed,
        "cases": [{k: v for k, v in c.items() if k not in ("job", "memory")} for c in cases],
    }


# --- out of memory in training ------------------------------------------------------------------------


def oom_budget(job_at, batch: int, device) -> tuple[Job, list[dict]]:
    """A budget under which the steady steps at `batch` run out of memory and those at half of it fit, checked in
    this process (the stage's trial): it starts OOM_BUDGET_AT of the way up from the allocated peak at half the batch
    to the one at the batch (without a cap, that step's peak) and moves between them until both hold. The job under
    that budget (resources.device_memory_gb, which the train stage runs under) and every check."""
    from tula_hpc.memory.device_budget import GB, budget_bytes
    from tula_hpc.profiling.memory_probes import run_in_this_process

    def trial(job: Job, b: int) -> dict:
        return run_in_this_process("trial", job, batch=b, budget=budget_bytes(job, device), ddp=False)

    roomy, half = job_at("auto"), batch // 2
    low, high = (trial(roomy, b)["peak_bytes"] for b in (half, batch))
    budget, checks = low + OOM_BUDGET_AT * (high - low), []
    for _ in range(OOM_BUDGET_MOVES):
        job = job_at(budget / GB)
        outcomes = {b: trial(job, b)["outcome"] for b in (batch, half)}
        checks.append({"budget_bytes": budget_bytes(job, device), **{f"b={b}": o for b, o in outcomes.items()}})
        if outcomes[batch] != "fits" and outcomes[half] == "fits":
            return job, checks
        low, high = (low, budget) if outcomes[batch] == "fits" else (budget, high)
        budget = (low + high) / 2
    raise RuntimeError(f"no budget between the peaks at {half} and {batch} fails {batch} and fits {half}: {checks}")


def real_out_of_memory(attempt: dict) -> bool:
    """The attempt ended in the allocator's own out-of-memory error (CUDA's, or the CPU budget allocator's)."""
    from tula_hpc.cluster.devices import is_out_of_memory

    return attempt.get("outcome") == "out_of_memory" and is_out_of_memory(RuntimeError(attempt.get("error", "")))


def oom_section(device: str, preset: dict, scratch: Path, context: dict) -> dict:
    """The train stage under a budget its selected batch does not fit (a real out-of-memory error) but half does."""
    from tula_hpc.core.atomic_files import read_json
    from tula_hpc.core.records import Selection
    from tula_hpc.stages.train import train

    spec = preset["oom"]
    batch, folder = spec["batch"], scratch / "oom"
    changes = {"train": {"epochs": spec["epochs"], "lr_milestones": []}}

    def job_at(budget_gb) -> Job:
        return workload_job(device, spec, "gpu-check-oom", batch, resources={"device_memory_gb": budget_gb}, **changes)

    started = time.perf_counter()
    job, checks = oom_budget(job_at, batch, torch_device(device))
    Selection.by_hand(job, {"nodes": 1, "batch": batch, "per_device_batch": batch}).write(folder / "selection.json")
    try:
        summary = train(job, folder / "selection.json", folder / "summary.json", folder / "model.pt", folder / "work")
        summary = summary.as_dict()
    except Exception as err:  # the stage's own failure is this section's finding; its attempts log says how far
        log = folder / "work" / "train" / "attempts.json"
        summary = {"error": f"{type(err).__name__}: {str(err)[-3000:]}", "attempts": []}
        summary["attempts"] = read_json(log)["attempts"] if log.exists() else []
    attempts = summary["attempts"]
    outcome = {
        "first_attempt_real_out_of_memory": bool(attempts) and real_out_of_memory(attempts[0]),
        "relaunched": len(attempts) >= 2,
        "global_batch_unchanged": bool(attempts)
        and all(a["global_batch"] == batch for a in attempts)
        and summary.get("global_batch") == batch,
        "completed": bool(attempts)
        and attempts[-1]["outcome"] == "completed"
        and len(summary.get("history", [])) == spec["epochs"],
    }
    return {
        "description": f"train stage at global batch {batch} under a budget checked in-process to fail {batch} and "
        f"fit {batch // 2} (steady steps), placed below the allocated peak at {batch}",
        "job": job.as_dict(),
        "budget_checks": checks,
        "budget_bytes": checks[-1]["budget_bytes"],
        "seconds": time.perf_counter() - started,
        "attempts": attempts,
        "summary": {k: v for k, v in summary.items() if k not in ("history", "attempts")},
        "epochs_trained": len(summary.get("history", [])),
        "steps_per_epoch": summary.get("steps_per_epoch"),
        "checks": outcome,
        "verdicts": {"relaunch_keeps_global_batch": {"met": all(outcome.values()), **outcome}},
    }
