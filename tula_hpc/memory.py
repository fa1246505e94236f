"""Stage `probe_memory`: the memory model of a training step and the largest per-device batch.

The model. A steady training step's peak is what grows with the per-device batch b (the batch, the
activations saved for backward, per-sample temporaries such as the gradients of activations and
batch-sized convolution buffers) on top of what does not (parameters, gradients, optimiser state, fixed
workspaces). Paper Eq. 3 sums the first kind as measured and leaves the temporaries out; measured here
they are 20-80 % of the peak. So each probe runs the steps training repeats (an ordinary step once the
optimiser state exists, and the strategy's update step, due after an epoch ends) and records the
allocator's own high-water mark in each phase (forward, backward, optimiser update) of each kind of
step. Each of those parts gets a line in b; the model is their upper envelope, M(b) = max_j (a_j + s_j b),
so the peak may move from the update phase at small batches to backward at large ones. Nothing depends
on two steps allocating in the same order, which kernels chosen by shape and processor (oneDNN, cuDNN,
cuBLAS workspaces) never guarantee.

Kernel choice. A kernel (and its workspace) picked for small batches can differ from the one for large
batches: tiny_cnn at 32x32 grows by 1.19 MB per sample between b = 32 and 64 and by 0.92 MB from 64 on.
So every line goes through the two largest probes (the regime nearest the large batches the model is
asked about), the smaller probes' distance from it is reported as `departure` (evidence of a switch in
the probed range), and probes are added, doubling, until the growing part is at least GROWING_SHARE of
the peak. A switch beyond the largest probe cannot be seen by any probe: the verification trials, real
steady steps at the proposed batch under the budget, catch it.

Which figure decides. A CUDA caching allocator reserves more than it allocates: it rounds blocks up, splits
segments and keeps freed blocks for reuse, and its cap (the budget) and its out-of-memory errors apply to what
it reserves. So every peak is read in both figures (torch.cuda.max_memory_allocated and max_memory_reserved;
cuDNN's and cuBLAS's workspaces are allocator blocks and count in both), each gets its own model, and the
reserved one (DECIDING_FIGURE) sizes the largest batch; memory.json reports both. On the device the card's
memory that the allocator cannot have (the CUDA context, other processes) is measured and taken off the budget.
On the CPU the budget allocator reserves exactly what it allocates, and both figures are one count.

Collectives. NCCL's buffers are outside the allocator: on several GPUs a probe measures its one-rank communicator
(`collective_library_bytes`, held outside the allocator), and a ring's buffers for its peers, which no one-rank group
has, are reserved as NCCL's defaults size them (budget.nccl_ring_buffer_bytes), like DDP's buckets. None on the CPU.

The stage. Every probe and trial runs in a fresh process (one probe's allocator and lazily built kernels
must not leak into the next) under the device budget (budget.py). The model proposes the largest batch;
at most MAX_VERIFICATION_TRIALS trials confirm or correct it, each using what the one before measured.
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

from . import launch
from .budget import (
    GB,
    DeviceBudgetError,
    budget_bytes,
    budget_source,
    device_memory,
    is_out_of_memory,
    model_bytes,
    nccl_ring_buffer_bytes,
    optimizer_state_bytes,
    saved_tensor_bytes,
    usable_bytes,
)
from .files import write_json
from .stage import StageError, stage_main

PHASES = ("forward", "backward", "update")
# The steps a probe runs: the first builds the optimiser state and is not measured; then the steps
# training repeats, an ordinary one, the strategy's update step (due once an epoch ends), and an
# ordinary one after it (the update may leave state behind).
STEPS = ("first", "ordinary", "update", "ordinary")
STEP_KINDS = ("ordinary", "update")
PARTS = tuple(f"{kind}/{phase}" for kind in STEP_KINDS for phase in PHASES)
GROWING_SHARE = 0.75  # the largest probe's peak is at least this much batch-dependent memory
MAX_PROBES = 6
MAX_VERIFICATION_TRIALS = 3
RETRY_STEP_DOWN = 0.1  # a retry after running out of memory is at least this share of that batch below it
PROBES_AT_ONCE = 2  # on the CPU: the rule's threads (workflow/rules/memory.smk)
# Each figure a peak is read in (budget.PEAK_COUNTS), and the key of a probe's peak per part in it.
PART_PEAKS = {"allocated": "peaks", "reserved": "reserved_peaks"}
PEAK = {"allocated": "peak_bytes", "reserved": "reserved_peak_bytes"}
DECIDING_FIGURE = "reserved"  # what the allocator's cap and its out-of-memory errors apply to

# --- the model --------------------------------------------------------------------------------------


class StepMemoryModel(BaseEstimator, RegressorMixin):
    """Peak device memory of a training step at per-device batch b: the highest of one line per part.

    `fit(batches, peaks)` takes each probe's peak of every part of the step (one row per probe; one
    column per part, or a single column of whole-step peaks) and draws each part's line through its
    peaks at the two largest probes. `departure_` is the largest relative distance of a probe's
    measured peak from the model.
    """

    def fit(self, batches, peaks) -> StepMemoryModel:
        batches = np.asarray(batches, float)
        peaks = np.asarray(peaks, float).reshape(len(batches), -1)
        if len(set(batches)) < 2:
            raise ValueError(f"a line needs probes at two batches, got {batches.tolist()}")
        below, top = np.argsort(batches)[-2:]
        self.slopes_ = (peaks[top] - peaks[below]) / (batches[top] - batches[below])
        self.intercepts_ = peaks[top] - self.slopes_ * batches[top]
        measured = peaks.max(axis=1)
        self.departure_ = float((np.abs(self.predict(batches) - measured) / measured).max())
        return self

    def predict(self, batches) -> np.ndarray:
        b = np.asarray(batches, float).reshape(-1, 1)
        return (self.intercepts_ + self.slopes_ * b).max(axis=1)

    def part_at(self, batch: int) -> int:
        """The column (part) whose line is the peak at `batch`."""
        return int(np.argmax(self.intercepts_ + self.slopes_ * batch))

    def line_at(self, batch: int) -> tuple[float, float]:
        """(intercept, slope) of the part that is the peak at `batch`: the model near that batch."""
        part = self.part_at(batch)
        return float(self.intercepts_[part]), float(self.slopes_[part])

    def growing_share(self, batch: int) -> float:
        """The share of the peak at `batch` that grows with the batch."""
        _, slope = self.line_at(batch)
        return float(slope * batch / self.predict([batch])[0])

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


def measured(probes: list[dict]) -> list[dict]:
    """The probes that ran, below the smallest batch that did not (memory grows with the batch)."""
    failed = [p["batch"] for p in probes if p["outcome"] != "measured"]
    return sorted(
        (p for p in probes if p["outcome"] == "measured" and p["batch"] < min(failed, default=np.inf)),
        key=lambda p: p["batch"],
    )


def fit_probes(probes: list[dict], figure: str = DECIDING_FIGURE) -> StepMemoryModel:
    return StepMemoryModel().fit(
        [p["batch"] for p in probes], [[p[PART_PEAKS[figure]][part] for part in PARTS] for p in probes]
    )


def room_for_steps(job: dict, budget: int, probes: list[dict]) -> int:
    """What the steps may fill: the budget, but never more of the card than its allocator can have (the card
    less what the probes saw held outside it), less resources.memory_headroom."""
    cards = [p["card_bytes"] - p["outside_allocator_bytes"] for p in probes if p.get("card_bytes")]
    return usable_bytes(job, min([budget, *cards]))


def next_probe(probes: list[dict], cap: int, budget: int) -> int | None:
    """The batch to probe next, or None once the probes settle the model.

    Two probes are the least a line needs: while fewer ran, half the smallest batch tried. Then, while
    the largest probe's peak is less than GROWING_SHARE growing memory (a fixed part that large hides
    the slope under workspace noise), twice the largest, as long as it is a batch training can run (at
    most `cap`, below any batch that failed) and the model expects it to fit `budget`.
    """
    tried, ran = {p["batch"] for p in probes}, measured(probes)
    if len(probes) >= MAX_PROBES:
        return None
    if len(ran) < 2:
        smaller = min(tried) // 2
        return smaller if smaller >= 1 else None
    model, largest = fit_probes(ran), ran[-1]["batch"]
    bigger = 2 * largest
    if model.growing_share(largest) >= GROWING_SHARE or bigger > cap or bigger in tried:
        return None
    return bigger if model.predict([bigger])[0] <= budget else None


def runs_on_several_devices(job: dict) -> bool:
    return job["search"]["nodes"]["max"] * max(1, job["resources"]["gpus_per_node"]) > 1


def ddp_bucket_bytes(job: dict, probes: list[dict]) -> int:
    """DDP's reducer keeps one more copy of the gradients on every rank of a multi-device run."""
    return probes[0]["grad_bytes"] if runs_on_several_devices(job) else 0


def collective_buffer_bytes(job: dict, device) -> int:
    """NCCL's ring buffers for its peers on every rank of a multi-GPU run (none on the CPU, whose gloo keeps
    its buffers in host memory outside the budget)."""
    return nccl_ring_buffer_bytes(os.environ) if device.type == "cuda" and runs_on_several_devices(job) else 0


def _largest_if_reached(model: StepMemoryModel, available: int, trial: dict, seen: float) -> int:
    """The largest batch once the slope of the prediction at `trial`'s batch is rescaled to the `seen` bytes."""
    intercept, slope = model.line_at(trial["batch"])
    corrected = StepMemoryModel()
    corrected.intercepts_ = model.intercepts_
    corrected.slopes_ = model.slopes_ * ((seen - intercept) / (slope * trial["batch"]) if slope > 0 else 1.0)
    return corrected.max_batch(available)


def next_trial(model: StepMemoryModel, available: int, trials: list[dict], cap: int) -> int | None:
    """The batch to try next when the step may use `available` bytes, or None when the trials settle it.

    The first trial is the model's largest batch; the bytes a trial reached (its peak, or where it ran out of
    memory) rescale the slope of the prediction at its batch. After the first trial that fits, one more goes up
    to the corrected largest batch. A retry after running out of memory is at least RETRY_STEP_DOWN below (the
    bytes reported are a lower bound, often just above the budget: a sample less would fail too), that step alone
    when they are unknown or not above `available`. No trial exceeds `cap` or a batch that failed, none falls to
    one that fit, and at most MAX_VERIFICATION_TRIALS run.
    """
    if not trials:
        return min(model.max_batch(available), cap) or None
    last, fitted = trials[-1], [t["batch"] for t in trials if t["outcome"] == "fits"]
    if len(trials) >= MAX_VERIFICATION_TRIALS or (last["outcome"] == "fits" and len(fitted) > 1):
        return None
    if last["outcome"] == "fits":
        batch = _largest_if_reached(model, available, last, last[PEAK[DECIDING_FIGURE]])
    else:
        batch, seen = int(last["batch"] * (1 - RETRY_STEP_DOWN)), last["failed_at_bytes"]
        if seen is not None and seen > available:
            batch = min(batch, _largest_if_reached(model, available, last, seen))
    batch = min([batch, cap, *(t["batch"] - 1 for t in trials if t["outcome"] != "fits")])
    return batch if batch > max(fitted, default=0) else None


def settle(trials: list[dict], fallback: int) -> tuple[int, bool]:
    """(largest batch, whether a verification trial confirmed it): the largest trial that fit, else
    `fallback` (the largest probe whose steps fit the usable budget)."""
    fitted = [t["batch"] for t in trials if t["outcome"] == "fits"]
    return (max(fitted), True) if fitted else (fallback, False)


def composition(model: StepMemoryModel, probe: dict, buckets: int, collective_buffers: int) -> dict:
    """What the peak near `probe`'s batch is made of: the measured parts of Eq. 3 and what they leave out."""
    intercept, slope = model.line_at(probe["batch"])
    fixed = {
        "parameters_and_buffers": probe["param_bytes"] + probe["buffer_bytes"],
        "optimizer_state": probe["optimizer_bytes"],
        "workspace": probe["workspace_bytes"],
        "autocast_weight_copies": probe["autocast_weight_bytes"],
    }
    batch, activations = (probe[k] / probe["batch"] for k in ("batch_bytes", "activation_bytes"))
    return {
        "fixed_bytes": {
            **fixed,
            "ddp_buckets": buckets,
            "nccl_ring_buffers": collective_buffers,
            "gradients_and_temporaries": intercept - sum(fixed.values()),
        },
        "per_sample_bytes": {
            "batch": batch,
            "saved_activations": activations,
            "temporaries": slope - batch - activations,
        },
    }


# --- probes and trials, each in its own process -------------------------------------------------------


def _device(job: dict):
    """The probe's device: the node's first GPU on a GPU job (never the CPU in its stead: `rank_gpu`)."""
    import torch

    from .devices import rank_gpu

    return torch.device("cuda", rank_gpu(0)) if job["resources"]["gpus_per_node"] > 0 else torch.device("cpu")


def _build(job: dict):
    """Data, model (on the device) and loss of the job, as training builds them."""
    import torch
    from torch import nn

    from .distributed import Context
    from .training import build_for_job

    torch.set_num_threads(job["resources"]["cpus_per_task"])
    splits, model = build_for_job(job, Context(0, 1, 0, _device(job)))
    return splits, model, nn.CrossEntropyLoss()


def _collated_batch(splits, batch: int, device):
    """`batch` real training samples (repeated if needed), collated as the DataLoader does, on the device."""
    from torch.utils.data import default_collate

    return [t.to(device) for t in default_collate([splits.train[i % len(splits.train)] for i in range(batch)])]


def steady_steps(net, strategy, loss_fn, next_batch, device) -> dict[str, dict[str, int]]:
    """The device's peak in every part (PARTS) of the steps training repeats (STEPS, the first not counted),
    in each figure (PART_PEAKS): {figure: {part: bytes}}.

    The phases are cut where the code is, not where allocations are: the network's forward returning,
    the gradients being accumulated, the update applied; the device's high-water marks are read and reset
    at each cut.
    """
    from .training import accumulate_gradients, apply_update

    peaks = {figure: dict.fromkeys(PARTS, 0) for figure in PART_PEAKS}
    cuts: dict[tuple[str, str], int] = {}

    def cut(phase: str) -> None:
        for figure in PART_PEAKS:
            cuts[figure, phase] = max(cuts.get((figure, phase), 0), device_memory.peak(device, figure))
        device_memory.reset_peak(device)

    handle = net.register_forward_hook(lambda *_: cut("forward"))
    try:
        for kind in STEPS:
            if kind == "update":
                strategy.end_epoch()
            x, y = next_batch()
            device_memory.reset_peak(device)
            cuts.clear()
            loss, reference_grads = accumulate_gradients(net, strategy, loss_fn, x, y)
            cut("backward")
            apply_update(net, strategy, loss_fn, x, y, reference_grads)
            cut("update")
            del x, y, loss, reference_grads
            if kind != "first":
                for figure in PART_PEAKS:
                    for phase in PHASES:
                        part = f"{kind}/{phase}"
                        peaks[figure][part] = max(peaks[figure][part], cuts.get((figure, phase), 0))
    finally:
        handle.remove()
    return peaks


def measure_probe(job: dict, batch: int) -> dict:
    """One probe: the peak of every part of the steady steps at `batch` under the device budget, and
    the measured terms of Eq. 3 (parameters, gradients, optimiser state, saved activations, the batch)."""
    from .data import loader_workers
    from .strategies import build_strategy

    splits, model, loss_fn = _build(job)
    device = _device(job)
    device_memory.limit(device, budget_bytes(job, device), model_bytes(model), job)
    strategy = build_strategy(model, job["train"], batch, 1)
    peaks = steady_steps(model, strategy, loss_fn, lambda: _collated_batch(splits, batch, device), device)
    params = list(model.parameters())
    resident, param_bytes = model_bytes(model), sum(p.nbytes for p in params)
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    optimizer_bytes = optimizer_state_bytes(strategy.optimizer)
    # What else the steps left on the device (cuBLAS's and cuDNN's workspaces), read before the next batch exists.
    workspace_bytes = device_memory.in_use(device) - resident - grad_bytes - optimizer_bytes
    x, y = _collated_batch(splits, batch, device)
    activation_bytes, autocast_weight_bytes = saved_tensor_bytes(model, loss_fn, x, y, strategy.precision)
    outside, library = device_memory.outside_allocator_with(device, collectives=runs_on_several_devices(job))
    return {
        "batch": batch,
        "outcome": "measured",
        **peak_fields(peaks),
        "card_bytes": device_memory.card_bytes(device),
        "outside_allocator_bytes": outside,
        "collective_library_bytes": library,
        "param_bytes": param_bytes,
        "buffer_bytes": resident - param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "workspace_bytes": workspace_bytes,
        "activation_bytes": activation_bytes,
        "autocast_weight_bytes": autocast_weight_bytes,
        "batch_bytes": x.nbytes + y.nbytes,
        "loader_prefetch_bytes": (x.nbytes + y.nbytes) * 2 * loader_workers(job),
    }


def trial_step(job: dict, batch: int, budget: int, ddp: bool) -> dict:
    """The steady steps at `batch` with the device limited to `budget`, as training runs them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .devices import join_one_rank_group
    from .strategies import build_strategy

    splits, model, loss_fn = _build(job)
    device = _device(job)
    device_memory.limit(device, budget, model_bytes(model), job)
    net = model
    if ddp:  # a one-rank group gives the model DDP's gradient buckets, which every rank holds
        join_one_rank_group(device)
        net = DDP(model)
    strategy = build_strategy(net, job["train"], batch, 1)
    peaks = steady_steps(net, strategy, loss_fn, lambda: _collated_batch(splits, batch, device), device)
    return {"batch": batch, "outcome": "fits", **{PEAK[f]: max(part_peaks.values()) for f, part_peaks in peaks.items()}}


def peak_fields(peaks: dict[str, dict[str, int]]) -> dict:
    """A probe's peaks per part and of the whole step, in every figure."""
    fields = {}
    for figure, part_peaks in peaks.items():
        fields[PEAK[figure]], fields[PART_PEAKS[figure]] = max(part_peaks.values()), part_peaks
    return fields


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
            "failed_at_bytes": device_memory.failed_at(_device(kwargs["job"]), err),
            "error": str(err)[:500],
        }


# --- the stage --------------------------------------------------------------------------------------


def run_probes(job: dict, cap: int, budget: int) -> list[dict]:
    """The configured probes (a fresh process each; two at once on two cores, one at a time on a GPU), then
    those `next_probe` adds, in the order they ran."""
    # On the CPU two probes share the cores; a GPU holds one probe at a time, each allowed the whole budget.
    at_once = 1 if job["resources"]["gpus_per_node"] > 0 else min(PROBES_AT_ONCE, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        probes = list(
            pool.map(
                lambda b: run_in_fresh_process("measure", job=job, batch=b), job["resources"]["memory_probe_batches"]
            )
        )
    while not any(p["outcome"] == "budget_too_small" for p in probes) and (batch := next_probe(probes, cap, budget)):
        probes.append(run_in_fresh_process("measure", job=job, batch=batch))
    return probes


def probe_worker(job: dict) -> dict:
    """Probes, then the verification trials at the usable budget (never above a batch that failed)."""
    from .data import load_splits

    splits, device = load_splits(job["data"], job["train"]["seed"]), _device(job)
    cap, budget, ring = len(splits.train), budget_bytes(job, device), collective_buffer_bytes(job, device)
    probes = run_probes(job, cap, budget)
    trials: list[dict] = []
    ran, usable = measured(probes), room_for_steps(job, budget, probes) - ring  # a one-rank trial has no ring
    if len(ran) >= 2:
        model, buckets = fit_probes(ran), ddp_bucket_bytes(job, ran)
        failed = [p["batch"] - 1 for p in probes if p["outcome"] == "out_of_memory"]
        while (batch := next_trial(model, usable - buckets, trials, min([cap, *failed]))) is not None:
            trial = run_in_fresh_process("trial", job=job, batch=batch, budget=usable, ddp=buckets > 0)
            trials.append(
                {**trial, **{k: trial[k] - buckets for k in (*PEAK.values(), "failed_at_bytes") if trial.get(k)}}
            )
    return {
        "probes": probes,
        "trials": trials,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget,
        "dataset": {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)},
    }


def fit_summary(model: StepMemoryModel, largest: int, ran: list[dict], unprobed: int) -> dict:
    """A figure's model near the largest batch, as memory.json reports it, with the `unprobed` fixed bytes that
    only a multi-device run holds (DDP's buckets, NCCL's ring)."""
    intercept, slope = model.line_at(largest)
    return {
        "intercept_bytes": intercept + unprobed,
        "slope_bytes_per_sample": slope,
        "peak_part": PARTS[model.part_at(largest)],
        "departure": model.departure_,
        "growing_share_at_largest_probe": model.growing_share(ran[-1]["batch"]),
    }


def _refuse(job: dict, budget: int, message: str) -> StageError:
    res = job["resources"]
    return StageError(
        f"job '{job['name']}': field 'resources.device_memory_gb': {res['device_memory_gb']} "
        f"({budget:,} bytes, {usable_bytes(job, budget):,} after {res['memory_headroom']:.0%} headroom) "
        f"{message}"
    )


def summarise(job: dict, measured_steps: dict) -> dict:
    """memory.json from the probes and trials; a budget that cannot hold batch 1 is a clear error."""
    probes, budget = measured_steps["probes"], measured_steps["device_memory_bytes"]
    for probe in probes:
        if probe["outcome"] == "budget_too_small":
            raise StageError(probe["error"])
    ran = measured(probes)
    if len(ran) < 2:
        smallest = min((p for p in probes if p["outcome"] != "measured"), key=lambda p: p["batch"])
        raise _refuse(
            job,
            budget,
            f"runs out of memory in a training step of {job['model']['name']} at batch {smallest['batch']}"
            + (f": it needs more than {smallest['failed_at_bytes']:,} bytes" if smallest.get("failed_at_bytes") else "")
            + "; the memory model needs steps at two batches",
        )
    model, buckets, ring = fit_probes(ran), ddp_bucket_bytes(job, ran), measured_steps["collective_buffer_bytes"]
    usable = room_for_steps(job, budget, probes)
    available = usable - buckets - ring
    proposed = model.max_batch(available)
    if proposed < 1:
        needed = int(model.predict([1])[0] + buckets + ring)
        raise _refuse(
            job,
            budget,
            f"cannot hold a training step of {job['model']['name']} even at batch 1: it needs "
            f"{needed:,} bytes ({needed / GB:.3f} GB)",
        )
    fitting_probes = [p["batch"] for p in ran if p[PEAK[DECIDING_FIGURE]] <= available]
    largest, verified = settle(measured_steps["trials"], max(fitting_probes, default=1))
    allocated = fit_probes(ran, "allocated")
    return {
        "job": job["name"],
        "model": "phase_lines",
        "probes": probes,
        "decided_by": DECIDING_FIGURE,
        "fit": fit_summary(model, largest, ran, buckets + ring),
        "fit_allocated": fit_summary(allocated, largest, ran, buckets + ring),
        "composition": composition(allocated, ran[-1], buckets, ring),
        "param_bytes": ran[0]["param_bytes"],
        "ddp_bucket_bytes": buckets,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget,
        "device_memory_source": budget_source(job),
        "headroom": job["resources"]["memory_headroom"],
        "usable_bytes": usable,
        "outside_allocator_bytes": max((p.get("outside_allocator_bytes", 0) for p in ran), default=0),
        "collective_library_bytes": max((p.get("collective_library_bytes", 0) for p in ran), default=0),
        "predicted_max_batch": proposed,
        "predicted_peak_bytes": int(model.predict([largest])[0] + buckets + ring),
        "verification": measured_steps["trials"],
        "verified": verified,
        "max_batch_per_device": largest,
        "limited_by": "training set" if proposed > largest == measured_steps["dataset"]["train"] else "memory",
        "dataset": measured_steps["dataset"],
    }


def probe_memory(job: dict, out: Path, work_dir: Path) -> dict:
    spec = launch.LaunchSpec.for_job(job, nodes=1, one_device=True, measuring_in=work_dir)
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
