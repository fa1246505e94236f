"""The memory model of a steady training step: what a probe's peaks mean and what they predict.

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
segments and keeps freed blocks for reuse. Uncapped, that slack grows with whatever the card has spare, so a
reserved peak says little about the limit; under its cap (the budget) the allocator frees its cached blocks and
retries before it raises out-of-memory, so what it cannot give back at the limit is only its fragmentation. So the
allocated peak (torch.cuda.max_memory_allocated: what the steps' tensors hold) sizes the batch (DECIDING_FIGURE),
and on CUDA the trials bracket the real limit (`next_bracket_trial`): what the allocator could not give back there
is measured as the room less the allocated model at the largest batch that ran (`cuda_choice`). On the H200 the
allocated model followed real steps within 1 %, the reserved one was off by -9 % to +19 % (bench/data/gpu/). Both
figures are fitted and reported. On the device the card's memory that the allocator cannot have (the CUDA context,
other processes) is measured and taken off the budget. On the CPU the budget allocator reserves exactly what it
allocates: both figures are one count, and nothing changes there.

Collectives. NCCL's buffers are outside the allocator: on several GPUs a probe measures its one-rank communicator
(`collective_library_bytes`, held outside the allocator), and a ring's buffers for its peers, which no one-rank group
has, are reserved as NCCL's defaults size them (budget.nccl_ring_buffer_bytes), like DDP's buckets. None on the CPU.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin

from tula_hpc.memory.device_budget import nccl_ring_buffer_bytes, runs_on_several_devices, usable_bytes
from tula_hpc.memory.step_parts import PART_PEAKS, PARTS, PEAK

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

GROWING_SHARE = 0.75  # the largest probe's peak is at least this much batch-dependent memory
MAX_PROBES = 6
MAX_VERIFICATION_TRIALS = 3
RETRY_STEP_DOWN = 0.1  # a retry after running out of memory is at least this share of that batch below it
DECIDING_FIGURE = "allocated"  # what the steps' tensors hold: the model that follows real steps (module docstring)
BRACKET = 0.01  # CUDA trials end with a batch that fits within this share of one that does not
BRACKET_STEP = 0.03  # until a bracket is found, trials move by this share of the batch, doubling each time
MAX_BRACKET_TRIALS = 12


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


def room_for_steps(job: Job, budget: int, probes: list[dict], headroom: bool = True) -> int:
    """What the steps may fill: the budget, but never more of the card than its allocator can have (the card
    less what the probes saw held outside it), less resources.memory_headroom (with `headroom`)."""
    cards = [p["card_bytes"] - p["outside_allocator_bytes"] for p in probes if p.get("card_bytes")]
    room = min([budget, *cards])
    return usable_bytes(job, room) if headroom else room


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


def ddp_bucket_bytes(job: Job, probes: list[dict]) -> int:
    """DDP's reducer keeps one more copy of the gradients on every rank of a multi-device run."""
    return probes[0]["grad_bytes"] if runs_on_several_devices(job) else 0


def collective_buffer_bytes(job: Job, device) -> int:
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


def _bracket(trials: list[dict], cap: int) -> tuple[int, int]:
    """(largest batch that ran, smallest that did not or cap + 1)."""
    fits = max((t["batch"] for t in trials if t["outcome"] == "fits"), default=0)
    return fits, min((t["batch"] for t in trials if t["outcome"] != "fits"), default=cap + 1)


def next_bracket_trial(model: StepMemoryModel, available: int, trials: list[dict], cap: int) -> int | None:
    """The batch to try next on CUDA, or None once a batch that fits lies within BRACKET of one that does not (or
    the batch that fits is `cap`, where the training set or search.batch.max, not memory, limits it).

    The first trial is the allocated model's largest batch for `available` bytes (no allowance: it is measured,
    not assumed). Until a bracket is found each trial moves BRACKET_STEP of the batch beyond the last, doubling
    (up after a fit, down after a failure); then it bisects. A trial that runs out of memory is cheap (it fails at
    its first large allocation), so starting at the allocated line costs little where fragmentation puts the limit
    below it. Never above `cap` or a batch that failed, at most MAX_BRACKET_TRIALS.
    """
    if not trials:
        return min(model.max_batch(available), cap) or None
    fits, fails = _bracket(trials, cap)
    if fits >= cap or (fits and fails - fits <= max(1, BRACKET * fits)) or len(trials) >= MAX_BRACKET_TRIALS:
        return None
    if fits and fails <= cap:
        return (fits + fails) // 2
    step, last = min(0.5, BRACKET_STEP * 2 ** (len(trials) - 1)), trials[-1]["batch"]
    batch = min(cap, int(last * (1 + step)) + 1) if fails > cap else int(last * (1 - step))  # up, or down
    return batch if fits < batch < fails else None


def cuda_choice(model: StepMemoryModel, trials: list[dict], room: int, budget: int, headroom: float, cap: int) -> dict:
    """The largest batch on CUDA from bracketing trials run under the budget with no headroom.

    `limit` is the largest batch that ran; the allocator's `allowance` is `room` (the budget the steps may fill)
    less the allocated model's peak there: what it could not give back at its limit (fragmentation), measured to
    the bracket's width. The job's headroom (a share of the budget kept free) then comes off that limit in bytes.
    `without_retry` is the largest trial whose steps needed no allocator retry (a retry frees the cache and
    synchronises the device: it costs time every step). Where `cap` (the training set, search.batch.max) ran,
    memory did not limit the batch and no allowance was measured.
    """
    limit, fails = _bracket(trials, cap)
    clean = [
        t["batch"] for t in trials if t["outcome"] == "fits" and t["allocator_events"].get("num_alloc_retries") == 0
    ]
    limited_by_memory = limit < cap
    at_limit = float(model.predict([limit])[0]) if limit else 0.0
    allowance = room - at_limit if limit and limited_by_memory else None
    reachable = at_limit if allowance is not None else max(room, at_limit)  # what the steps were seen to hold
    chosen = min(limit, model.max_batch(reachable - headroom * budget)) if limit else 0
    return {
        "limit": limit,
        "smallest_failed": fails if fails <= cap else None,
        "without_retry": max(clean, default=None),
        "allowance_bytes": allowance,
        "chosen": chosen,
        "limited_by_memory": limited_by_memory,
    }


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
