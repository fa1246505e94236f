"""Stage `probe_memory`: the memory model of a training step and the largest per-device batch.

The model. Paper Eq. 3 sums M_param + M_grad + M_opt + M_act(b) + M_batch(b). Measured on the real
model, that sum misses what decides out-of-memory: the transient workspace alive at the step's peak
(gradients of activations, convolution buffers, optimiser temporaries), often several times M_act.
So each probe records the allocator's timeline of one real training step: every point of it is
linear in the per-device batch b (the same tensors, each of fixed size or proportional to b), and the
peak is the highest point. A linear fit per point over the probe batches (scikit-learn, multi-output)
gives M(b) = max_t (a_t + s_t b): convex and piecewise linear, exact wherever the probes' timelines
align, where a single line through the probes' peaks (the paper's fit) under-predicts large batches
because the peak moves to a point with a steeper slope. The Eq. 3 components are still measured and
reported per probe, together with what they leave out.

The stage. Each probe batch runs in a fresh process (the allocator and lazily built kernels of one
probe must not leak into the next), under the device budget (budget.py). The model proposes the largest batch; at most
two real steps at the proposed batch, in fresh processes under the usable budget, confirm or correct it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression

from . import launch
from .budget import (
    GB,
    DeviceBudgetError,
    budget_bytes,
    device_memory,
    is_out_of_memory,
    model_bytes,
    usable_bytes,
)
from .files import write_json
from .stage import StageError, stage_main

MAX_VERIFICATION_TRIALS = 2
PROBES_AT_ONCE = 2  # the rule's threads (workflow/rules/memory.smk)
# Probe timelines are exactly linear in the batch; anything above this share of the peak means the
# probes' steps differ in more than their sizes (a kernel switch between probe batches).
ALIGNMENT_TOLERANCE = 1e-6

# --- the model --------------------------------------------------------------------------------------


class StepMemoryModel(BaseEstimator, RegressorMixin):
    """Device memory of a training step at per-device batch b: the highest of one line per timeline point.

    `fit(batches, timelines)` takes each probe's allocator timeline (bytes on the device after every
    allocation and free of one step, the same number of points for every probe) and fits every point
    linearly in b. Given one number per probe (its peak), it is the paper's single line.
    """

    def fit(self, batches, timelines) -> StepMemoryModel:
        batches = np.asarray(batches, float).reshape(-1, 1)
        timelines = np.asarray(timelines, float).reshape(len(batches), -1)
        regression = LinearRegression().fit(batches, timelines)
        self.intercepts_ = np.atleast_1d(regression.intercept_).astype(float)
        self.slopes_ = np.atleast_1d(regression.coef_.reshape(-1)).astype(float)
        residual = np.abs(timelines - regression.predict(batches)).max()
        self.rel_residual_ = float(residual / timelines.max())
        return self

    def predict(self, batches) -> np.ndarray:
        b = np.asarray(batches, float).reshape(-1, 1)
        return (self.intercepts_ + self.slopes_ * b).max(axis=1)

    def line_at(self, batch: int) -> tuple[float, float]:
        """(intercept, slope) of the point that is the peak at `batch`: the model near that batch."""
        point = int(np.argmax(self.intercepts_ + self.slopes_ * batch))
        return float(self.intercepts_[point]), float(self.slopes_[point])

    def max_batch(self, available_bytes: float) -> int:
        """Largest batch whose predicted peak fits in `available_bytes` (0 if not even batch 1 does)."""
        growing = self.slopes_ > 0
        if not growing.any():
            raise ValueError("memory does not grow with the batch: the probes cannot be extrapolated")
        if (self.intercepts_[~growing] > available_bytes).any():
            return 0
        # Rounded first: a fitted slope of 2.9999999 must not turn an exact 60 into 59.
        largest = np.floor(np.round((available_bytes - self.intercepts_[growing]) / self.slopes_[growing], 6)).min()
        return max(0, int(largest))


def fit_probes(probes: list[dict]) -> StepMemoryModel:
    """The timeline model when the probes' steps align point for point, else the line through their peaks."""
    batches = [p["batch"] for p in probes]
    if len({len(p["timeline"]) for p in probes}) == 1:
        model = StepMemoryModel().fit(batches, [p["timeline"] for p in probes])
        if model.rel_residual_ <= ALIGNMENT_TOLERANCE:
            return model
    return StepMemoryModel().fit(batches, [p["measured_peak_bytes"] for p in probes])


def runs_on_several_devices(job: dict) -> bool:
    return job["search"]["nodes"]["max"] * max(1, job["resources"]["gpus_per_node"]) > 1


def ddp_bucket_bytes(job: dict, probes: list[dict]) -> int:
    """DDP's reducer keeps one more copy of the gradients on every rank of a multi-device run."""
    return probes[0]["grad_bytes"] if runs_on_several_devices(job) else 0


def next_trial(model: StepMemoryModel, available: int, trials: list[dict], cap: int) -> int | None:
    """The batch to try next when the step may use `available` bytes, or None when the trials settle it.

    The first trial is the model's largest batch. A second one follows only if the first corrects the
    model: the bytes it reached (its peak, or where it ran out of memory) rescale the slope of the
    prediction at that batch, and the corrected largest batch is larger (it fit) or smaller (it did not).
    No trial exceeds `cap`, the training set: no device ever sees a larger batch.
    """
    if not trials:
        return min(model.max_batch(available), cap) or None
    last = trials[-1]
    if len(trials) >= MAX_VERIFICATION_TRIALS or (last["outcome"] == "fits" and last["batch"] >= cap):
        return None
    seen = last["peak_bytes"] if last["outcome"] == "fits" else (last["failed_at_bytes"] or available + 1)
    intercept, slope = model.line_at(last["batch"])
    corrected = StepMemoryModel()
    corrected.intercepts_ = model.intercepts_
    corrected.slopes_ = model.slopes_ * ((seen - intercept) / (slope * last["batch"]) if slope > 0 else 1.0)
    batch = corrected.max_batch(available)
    if last["outcome"] == "fits":
        return min(batch, cap) if batch > last["batch"] else None
    return min(batch, last["batch"] - 1) or None


def settle(trials: list[dict]) -> tuple[int, bool]:
    """(largest batch, whether a real step confirmed it): the largest trial that fit, else half the last."""
    fitted = [t["batch"] for t in trials if t["outcome"] == "fits"]
    if fitted:
        return max(fitted), True
    return max(1, trials[-1]["batch"] // 2), False


# --- one probe, in its own process ------------------------------------------------------------------


def _device(job: dict):
    import torch

    use_gpu = job["resources"]["gpus_per_node"] > 0 and torch.cuda.is_available()
    return torch.device("cuda", 0) if use_gpu else torch.device("cpu")


def _build(job: dict, threads: int):
    """Data, model (on the device, under the budget) and loss of the job, as training builds them."""
    import torch
    from torch import nn

    from .distributed import Context
    from .training import build_for_job

    torch.set_num_threads(threads)
    splits, model = build_for_job(job, Context(0, 1, 0, _device(job)))
    return splits, model, nn.CrossEntropyLoss()


def _collated_batch(splits, batch: int, device):
    """`batch` real training samples (repeated if needed), collated as the DataLoader does, on the device."""
    from torch.utils.data import default_collate

    return [t.to(device) for t in default_collate([splits.train[i % len(splits.train)] for i in range(batch)])]


def _storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _allocations(prof, device) -> list:
    """The profiler's allocation and free events on `device`, in order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == device.type:
            events.append(event)
        stack.extend(event.children)
    return sorted(events, key=lambda e: e.start_time_ns)


def _live_after(events: list, index: int) -> dict[int, int]:
    """Allocations made in the profiled region (pointer -> bytes) still alive right after event `index`."""
    live: dict[int, int] = {}
    for event in events[: index + 1]:
        if event.extra_fields.alloc_size > 0:
            live[event.extra_fields.ptr] = event.extra_fields.alloc_size
        else:
            live.pop(event.extra_fields.ptr, None)
    return live


def measure_probe(job: dict, batch: int) -> dict:
    """One probe: the allocator timeline of a steady training step at `batch`, under the device budget.

    A first step at `batch` builds the kernels and the optimiser state (for gradient scaling also its
    factors); closing the epoch makes the step that runs once per epoch due. The measured step then
    fetches the batch, runs forward and backward with every saved tensor seen by a hook, the strategy's
    hooks and the update. Both steps are profiled, so frees of the first step's tensors are counted.
    One thread, so the timeline's order is the same in every probe.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .strategies import build_strategy
    from .training import training_step

    splits, model, loss_fn = _build(job, threads=1)
    device = _device(job)
    params = list(model.parameters())
    device_memory.limit(device, budget_bytes(job), model_bytes(model), job)
    strategy = build_strategy(model, job["train"], batch, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True):
        training_step(model, strategy, loss_fn, *_collated_batch(splits, batch, device))
        strategy.end_epoch()
        strategy.optimizer.zero_grad(set_to_none=True)
    base = device_memory.in_use(device)
    device_memory.reset_peak(device)

    parameters = {_storage(p) for p in params}
    saved: dict[int, int] = {}

    def see(tensor):
        if _storage(tensor) not in parameters:
            saved[_storage(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with (
        profile(activities=activities, profile_memory=True) as prof,
        torch.autograd.graph.saved_tensors_hooks(see, lambda t: t),
    ):
        x, y = _collated_batch(splits, batch, device)
        training_step(model, strategy, loss_fn, x, y)
    events = _allocations(prof, device)
    timeline = base + np.cumsum([e.extra_fields.alloc_size for e in events])
    peak = int(np.argmax(timeline))

    inputs = {_storage(x): x.nbytes, _storage(y): y.nbytes}
    grads = {_storage(p.grad): p.grad.nbytes for p in params if p.grad is not None}
    activations = {ptr: size for ptr, size in saved.items() if ptr not in inputs}
    at_peak = dict.fromkeys(("batch", "gradients", "activations", "workspace"), 0)
    for ptr, size in _live_after(events, peak).items():
        kind = (
            "batch"
            if ptr in inputs
            else "gradients"
            if ptr in grads
            else "activations"
            if ptr in activations
            else "workspace"
        )
        at_peak[kind] += size
    resident = model_bytes(model)
    return {
        "batch": batch,
        "outcome": "measured",
        "measured_peak_bytes": int(timeline[peak]),
        "allocator_peak_bytes": device_memory.peak(device),
        "param_bytes": sum(p.nbytes for p in params),
        "buffer_bytes": resident - sum(p.nbytes for p in params),
        "grad_bytes": sum(grads.values()),
        "optimizer_bytes": base - resident,
        "activation_bytes": sum(activations.values()),
        "batch_bytes": sum(inputs.values()),
        "loader_prefetch_bytes": sum(inputs.values()) * 2 * job["data"]["num_workers"],
        "at_peak": {"model": resident, "optimizer_state": base - resident, **at_peak},
        "timeline": timeline.astype(int).tolist(),
    }


def trial_step(job: dict, batch: int, budget: int, ddp: bool) -> dict:
    """Two real training steps at `batch` with the device limited to `budget`, as training runs them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .strategies import build_strategy
    from .training import training_step

    splits, model, loss_fn = _build(job, threads=job["resources"]["cpus_per_task"])
    device = _device(job)
    device_memory.limit(device, budget, model_bytes(model), job)
    net = model
    if ddp:  # a one-rank group gives the model DDP's gradient buckets, which every rank holds
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        net = DDP(model)
    strategy = build_strategy(net, job["train"], batch, 1)
    for _ in range(2):
        training_step(net, strategy, loss_fn, *_collated_batch(splits, batch, device))
        strategy.end_epoch()
    return {"batch": batch, "outcome": "fits", "peak_bytes": device_memory.peak(device)}


def run_in_fresh_process(kind: str, **kwargs) -> dict:
    """`measure_probe` or `trial_step` in a new interpreter; its answer is the last line it prints."""
    env = {**os.environ, "OMP_NUM_THREADS": str(kwargs["job"]["resources"]["cpus_per_task"])}
    proc = subprocess.run(
        [sys.executable, "-m", "tula_hpc.memory", "--in-process", kind, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory {kind} at batch {kwargs['batch']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _answer_in_process(kind: str, kwargs: dict) -> dict:
    """The probe's or trial's result; running out of memory (or budget) is an answer, not a crash."""
    try:
        return {"measure": measure_probe, "trial": trial_step}[kind](**kwargs)
    except DeviceBudgetError as err:
        return {"batch": kwargs["batch"], "outcome": "budget_too_small", "error": str(err)}
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        return {
            "batch": kwargs["batch"],
            "outcome": "out_of_memory",
            "failed_at_bytes": device_memory.failed_at(_device(kwargs["job"])),
            "error": str(err)[:500],
        }


# --- the stage --------------------------------------------------------------------------------------


def probe_worker(job: dict) -> dict:
    """Probes (a fresh process each, two at once when there are two cores), then the verification trials."""
    from .data import load_splits

    with ThreadPoolExecutor(max_workers=min(PROBES_AT_ONCE, len(os.sched_getaffinity(0)))) as pool:
        answers = list(
            pool.map(
                lambda b: run_in_fresh_process("measure", job=job, batch=b), job["resources"]["memory_probe_batches"]
            )
        )
    probes = answers[: next((i + 1 for i, p in enumerate(answers) if p["outcome"] != "measured"), len(answers))]
    splits = load_splits(job["data"], job["train"]["seed"])
    trials: list[dict] = []
    if probes[-1]["outcome"] == "measured":
        model, buckets = fit_probes(probes), ddp_bucket_bytes(job, probes)
        while (batch := next_trial(model, usable_bytes(job) - buckets, trials, len(splits.train))) is not None:
            trial = run_in_fresh_process("trial", job=job, batch=batch, budget=usable_bytes(job), ddp=buckets > 0)
            trials.append(
                {**trial, **{k: trial[k] - buckets for k in ("peak_bytes", "failed_at_bytes") if trial.get(k)}}
            )
    return {
        "probes": probes,
        "trials": trials,
        "dataset": {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)},
    }


def _refuse(job: dict, message: str) -> StageError:
    res = job["resources"]
    return StageError(
        f"job '{job['name']}': field 'resources.device_memory_gb': {res['device_memory_gb']} GB "
        f"({budget_bytes(job):,} bytes, {usable_bytes(job):,} after {res['memory_headroom']:.0%} headroom) "
        f"{message}"
    )


def summarise(job: dict, measured: dict) -> dict:
    """memory.json from the probes and trials; a budget that cannot hold batch 1 is a clear error."""
    probes = measured["probes"]
    if probes[-1]["outcome"] == "budget_too_small":
        raise StageError(probes[-1]["error"])
    if probes[-1]["outcome"] == "out_of_memory":
        raise _refuse(
            job,
            f"runs out of memory in a training step of {job['model']['name']} at probe batch "
            f"{probes[-1]['batch']}: it needs more than {probes[-1]['failed_at_bytes']:,} bytes",
        )
    model, buckets = fit_probes(probes), ddp_bucket_bytes(job, probes)
    proposed = model.max_batch(usable_bytes(job) - buckets)
    if proposed < 1:
        needed = int(model.predict([1])[0] + buckets)
        raise _refuse(
            job,
            f"cannot hold a training step of {job['model']['name']} even at batch 1: it needs "
            f"{needed:,} bytes ({needed / GB:.3f} GB)",
        )
    largest, verified = settle(measured["trials"])
    intercept, slope = model.line_at(largest)
    return {
        "job": job["name"],
        "model": "timeline" if len(model.slopes_) > 1 else "peak_line",
        "probes": [{k: v for k, v in p.items() if k != "timeline"} for p in probes],
        "fit": {
            "intercept_bytes": intercept + buckets,
            "slope_bytes_per_sample": slope,
            "timeline_points": len(model.slopes_),
            "rel_residual": model.rel_residual_,
        },
        "param_bytes": probes[0]["param_bytes"],
        "ddp_bucket_bytes": buckets,
        "device_memory_bytes": budget_bytes(job),
        "headroom": job["resources"]["memory_headroom"],
        "usable_bytes": usable_bytes(job),
        "predicted_max_batch": proposed,
        "predicted_peak_bytes": int(model.predict([largest])[0] + buckets),
        "verification": measured["trials"],
        "verified": verified,
        "max_batch_per_device": largest,
        "limited_by": "training set" if proposed > largest == measured["dataset"]["train"] else "memory",
        "dataset": measured["dataset"],
    }


def probe_memory(job: dict, out: Path, work_dir: Path) -> dict:
    spec = launch.LaunchSpec.for_job(job, nodes=1, one_device=True)
    measured = launch.run(
        probe_worker, dict(job=job), spec, Path(work_dir) / "probe_memory", name=f"{job['name']}-probe-memory"
    )
    result = summarise(job, measured)
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--in-process"]:
        with contextlib.redirect_stdout(sys.stderr):
            answer = _answer_in_process(argv[1], json.loads(argv[2]))
        print(json.dumps(answer))
        return 0

    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/memory.json")

    return stage_main("probe-memory", add_args, lambda job, args: probe_memory(job, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
