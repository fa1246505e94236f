"""The truth of the largest batch on a GPU, recorded as replay cases (bench/data/gpu/, bench/memory_replay.py).

For each case (model, image size, precision, memory format) on the synthetic data set at the case's shape, in one
process: the probe stage's own probes (`memory_probes.run_in_this_process("measure")`, the configured batches and
those `memory_model.next_probe` adds), then a bisection of the card's real limit with the stage's own verification
trial (`trial_step`: the steady steps training repeats, under the whole card), from the allocated-peak model's
largest batch, by the stage's own rule for its CUDA trials (`memory_model.next_bracket_trial`: steps that double, then
bisection) until a batch that fits and one that does not lie within its BRACKET of each other. Every trial keeps its
outcome, peaks, the allocator's retries and out-of-memory counts during it, its error text and its seconds. Before
the probes, WARMUP_STEPS plain training steps are timed one by one (the first steps of a new shape build cuDNN's and
cuBLAS's plans: the warm-up a short job pays).

The allocator's settings are the environment's (PYTORCH_CUDA_ALLOC_CONF), recorded in each case: run it once as is
and once with expandable_segments:True to compare. Each case file is written as it ends; cases that would start past
--deadline-s are skipped, saying so.

Run:  bash scripts/gpu-python.sh bench/gpu_truth.py --out-dir bench/data/gpu
      .venv/bin/python bench/gpu_truth.py --device cpu --scale quick --out-dir /tmp/truth   (this code's own test)
      .venv/bin/python bench/gpu_truth.py --smoke --out FILE   (seconds: the quick case on the CPU under SMOKE_MEMORY_GB
      with SMOKE_WARMUP_STEPS, the run in one file and no case file; CI's check, a failed case its exit status)
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

from tula_bench.common import bench_job, parse_bench_args
from tula_bench.gpu_device import device_info, provenance_here
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.job import Job

NO_CAP = 2**40  # the truth is the card's limit, not the training set's
WARMUP_STEPS = 25
CASES = {
    "resnet18_32_fp32": {"model": "resnet18", "image_size": 32, "precision": "fp32", "warmup_batch": 512},
    "resnet18_32_bf16": {"model": "resnet18", "image_size": 32, "precision": "bf16", "warmup_batch": 512},
    "resnet50_224_bf16_cl": {
        "model": "resnet50",
        "image_size": 224,
        "precision": "bf16",
        "channels_last": True,
        "warmup_batch": 128,
    },
    "vit_b_16_224_bf16": {
        "model": "torchvision.models:vit_b_16",
        "image_size": 224,
        "precision": "bf16",
        "warmup_batch": 128,
    },
}
QUICK = {"tiny_cnn_8_fp32": {"model": "tiny_cnn", "image_size": 8, "precision": "fp32", "warmup_batch": 32}}
# --smoke: the quick case under a budget of a few hundred samples (its bisection then takes seconds, not minutes).
SMOKE_MEMORY_GB = 0.01
SMOKE_WARMUP_STEPS = 2


def index_cap(job: Job, splits) -> int:
    """tula_hpc.training.models.index_cap of the job's model for its data (`splits`' shape)."""
    from tula_hpc.training import models
    from tula_hpc.training.tasks import job_task

    return models.index_cap(job.model.name, splits.shape, job.model.kwargs, job_task(job))


def case_job(name: str, case: dict, device: str, memory_gb) -> Job:
    """The default job with the case's model and precision on synthetic data of its shape, one device, no headroom."""
    return bench_job(
        as_name=name,
        model={"name": case["model"]},
        data={
            "name": "synthetic",
            "image_size": case["image_size"],
            "kwargs": {"size": 1_000_000, "classes": case.get("classes", 10)},
        },
        train={"precision": case["precision"], "channels_last": case.get("channels_last", False)},
        search={"nodes": {"min": 1, "max": 1}},
        resources={
            "gpus_per_node": 1 if device == "cuda" else 0,
            "device_memory_gb": memory_gb,
            "memory_headroom": 0.0,
        },
    )


def timed_steps(job: Job, batch: int, count: int) -> list[float]:
    """Seconds of each of `count` plain training steps at `batch`, the device synchronised after each."""
    from tula_hpc.profiling.memory_probes import build_probe_setup, probe_device, shaped_batch
    from tula_hpc.training.step import accumulate_gradients, apply_update, clock_for
    from tula_hpc.training.strategies import build_strategy

    splits, model, task = build_probe_setup(job)
    device = probe_device(job)
    clock = clock_for(device)
    strategy = build_strategy(model, job.train, batch, 1000)
    example = shaped_batch(splits, task, batch, device)
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        _, reference = accumulate_gradients(model, strategy, task, example)
        apply_update(model, strategy, task, example, reference)
        clock.wait()
        seconds.append(time.perf_counter() - started)
    return seconds


def probes_of(job: Job, cap: int) -> tuple[list[dict], float]:
    """The stage's probes in this process (configured, then `next_probe`'s), and their seconds."""
    from tula_hpc.memory.device_budget import budget_bytes
    from tula_hpc.memory.model import next_probe
    from tula_hpc.profiling.memory_probes import probe_device, run_in_this_process

    started, budget = time.perf_counter(), budget_bytes(job, probe_device(job))
    probes = [run_in_this_process("measure", job, batch=b) for b in job.resources.memory_probe_batches]
    while not any(p["outcome"] == "budget_too_small" for p in probes) and (batch := next_probe(probes, cap, budget)):
        probes.append(run_in_this_process("measure", job, batch=batch))
    return probes, time.perf_counter() - started


def trial(job: Job, batch: int, budget: int) -> dict:
    """The stage's verification trial at `batch` here; an error other than running out of memory is an outcome."""
    from tula_hpc.profiling.memory_probes import run_in_this_process

    started = time.perf_counter()
    try:
        result = run_in_this_process("trial", job, batch=batch, budget=budget, ddp=False)
    except Exception as err:  # a kernel refusing a size (2^31 elements) is a finding: the batch does not run
        result = {"batch": batch, "outcome": "error", "error": f"{type(err).__name__}: {str(err)[:600]}"}
    result["seconds"] = time.perf_counter() - started
    events = result.get("allocator_events", {})
    print(
        f"  trial b={batch}: {result['outcome']}"
        + "".join(f" {k}={result[k] / 1e9:.2f}GB" for k in ("peak_bytes", "reserved_peak_bytes") if k in result)
        + f" retries={events.get('num_alloc_retries')} ooms={events.get('num_ooms')} {result['seconds']:.1f}s",
        flush=True,
    )
    return result


def bisect(job: Job, model, room: int, budget: int, deadline: float) -> tuple[list[dict], dict]:
    """Real trials chosen by the stage's own rule (memory_model.next_bracket_trial, from the allocated model's largest
    batch for `room`) until a fitting and a failing batch lie within its BRACKET (or its trial limit, or the
    deadline): the trials and the truth they found (memory_model.cuda_choice reads it off them)."""
    from tula_hpc.memory.model import cuda_choice, next_bracket_trial

    trials: list[dict] = []
    while time.monotonic() < deadline and (batch := next_bracket_trial(model, room, trials, NO_CAP)) is not None:
        trials.append(trial(job, batch, budget))
    found = cuda_choice(model, trials, room, budget, 0.0, NO_CAP)
    fits, fails = found["limit"] or None, found["smallest_failed"]
    truth = {
        "largest_fits": fits,
        "smallest_fails": fails,
        "largest_fits_without_retry": found["without_retry"],
        "bracketed_within": (fails - fits) / fits if fits and fails else None,
        "how": (
            "bisection of real steady steps (memory_probes.trial_step: ordinary, update and ordinary steps after a "
            "first) in one process under the whole card, from the allocated-peak model's largest batch"
        ),
    }
    return trials, truth


def run_case(
    name: str, case: dict, device: str, memory_gb, deadline: float, stamp: dict, warmup_steps: int = WARMUP_STEPS
) -> dict:
    import torch

    from tula_hpc.memory.device_budget import budget_bytes, device_memory
    from tula_hpc.memory.model import fit_probes, measured, room_for_steps
    from tula_hpc.profiling.memory_probes import probe_device
    from tula_hpc.training.datasets import load_splits

    job = case_job(name, case, device, memory_gb)
    print(f"== {name}", flush=True)
    warmup = timed_steps(job, case["warmup_batch"], warmup_steps)
    device_memory.release(probe_device(job))
    print(f"  warm-up at b={case['warmup_batch']}: " + " ".join(f"{s * 1e3:.0f}" for s in warmup[:6]) + " ms ...")
    splits = load_splits(job.data, job.train.seed)
    probes, probe_seconds = probes_of(job, len(splits.train))
    ran = measured(probes)
    budget = budget_bytes(job, probe_device(job))
    room = room_for_steps(job, budget, probes)
    model = fit_probes(ran, "allocated")
    first = model.max_batch(room)
    print(f"  probes {[p['batch'] for p in probes]} in {probe_seconds:.1f}s; allocated model: {first}", flush=True)
    trials, truth = bisect(job, model, room, budget, deadline)
    return {
        "case": name,
        "recorded": stamp,
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        "shape": {k: case.get(k) for k in ("model", "image_size", "precision", "channels_last")},
        "job": job.as_dict(),
        "memory": {"probes": probes, "device_memory_bytes": budget, "dataset_train": len(splits.train)},
        "index_cap": index_cap(job, splits),
        "trials": trials,
        "truth": truth,
        "seconds": {"probes": probe_seconds, "trials": sum(t["seconds"] for t in trials)},
        "warmup": {"batch": case["warmup_batch"], "step_seconds": warmup},
    }


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --smoke is the quick case on the CPU and writes --out alone (never a case file)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, help="where each case's file goes (required, but with --smoke)")
    parser.add_argument("--out", type=Path, help="also the whole run in one file: provenance, settings, every case")
    parser.add_argument("--smoke", action="store_true", help="the quick case on the CPU, seconds (CI's check)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--scale", choices=("gpu", "quick"), default="gpu")
    parser.add_argument("--cases", nargs="+", help="names of CASES (default: all of the scale's)")
    parser.add_argument("--suffix", default="", help="added to each case's file name (e.g. _expandable)")
    parser.add_argument("--deadline-s", type=float, default=420.0, help="no case starts after this many seconds")
    args = parse_bench_args(parser, argv)
    if args.smoke and args.out_dir is not None:
        parser.error("--smoke writes --out alone: a smoke run never adds a case to bench/data/gpu")
    if not args.smoke and args.out_dir is None:
        parser.error("--out-dir is required")
    if args.smoke:
        args.device, args.scale = "cpu", "quick"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    cases = CASES if args.scale == "gpu" else QUICK
    chosen = args.cases or list(cases)
    deadline = time.monotonic() + args.deadline_s
    found, info = provenance_here(), device_info(args.device)
    stamp = {"device": info, "git_commit": found["git_commit"], "source_digest": found["source_digest"]}
    memory_gb = SMOKE_MEMORY_GB if args.smoke else "auto" if args.device == "cuda" else 0.2
    warmup_steps = SMOKE_WARMUP_STEPS if args.smoke else WARMUP_STEPS
    records, failed = {}, []
    for name in chosen:
        if time.monotonic() > deadline:
            print(f"== {name}: skipped, past the deadline of {args.deadline_s:.0f} s", flush=True)
            continue
        try:
            records[name] = run_case(name, cases[name], args.device, memory_gb, deadline, stamp, warmup_steps)
        except Exception:
            print(traceback.format_exc(), flush=True)
            failed.append(name)
            continue
        if args.out_dir is not None:
            path = args.out_dir / f"{name}{args.suffix}.json"
            write_json(path, records[name])
            print(f"  truth {records[name]['truth']}; wrote {path}", flush=True)
    if args.out is not None:
        settings = {"smoke": args.smoke, "device": args.device, "scale": args.scale, "memory_gb": memory_gb}
        settings |= {"warmup_steps": warmup_steps, "cases": chosen, "failed": failed}
        write_json(args.out, {"provenance": found, "settings": settings, "cases": records})
        print(f"wrote {args.out}", flush=True)
    return 1 if args.smoke and failed else 0  # a GPU run goes on past a failed case; CI's check does not
