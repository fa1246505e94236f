"""Memory probes and verification trials, each in a fresh process (one probe's allocator and lazily built kernels
must not leak into the next) under the device budget (memory/device_budget.py):
`python -m tula_hpc.profiling.memory_probes KIND JSON` prints the answer as its last line; running out of memory is
an answer, not a crash."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from tula_hpc.cluster.devices import is_out_of_memory
from tula_hpc.core.job import Job
from tula_hpc.memory.device_budget import (
    DeviceBudgetError,
    budget_bytes,
    device_memory,
    model_bytes,
    optimizer_state_bytes,
    runs_on_several_devices,
    saved_tensor_bytes,
)
from tula_hpc.memory.step_parts import PART_PEAKS, PARTS, PEAK, PHASES

# The steps a probe runs: the first builds the optimiser state and is not measured; then the steps
# training repeats, an ordinary one, the strategy's update step (due once an epoch ends), and an
# ordinary one after it (the update may leave state behind).
STEPS = ("first", "ordinary", "update", "ordinary")


def probe_device(job: Job):
    """The probe's device: the node's first GPU on a GPU job (never the CPU in its stead: `rank_gpu`)."""
    import torch

    from tula_hpc.cluster.devices import rank_gpu

    return torch.device("cuda", rank_gpu(0)) if job.resources.gpus_per_node > 0 else torch.device("cpu")


def build_probe_setup(job: Job):
    """Data, model (on the device) and task of the job, as training builds them: what a probe, a trial or a
    benchmark's ground truth steps on."""
    import torch

    from tula_hpc.cluster.distributed import Context
    from tula_hpc.training.step import build_for_job
    from tula_hpc.training.tasks import job_task

    torch.set_num_threads(job.resources.cpus_per_task)
    splits, model = build_for_job(job, Context(0, 1, 0, probe_device(job)))
    return splits, model, job_task(job)


def shaped_batch(splits, task, batch: int, device):
    """`batch` random samples of the data's shape (task.example_batch), made on the device from a generator seeded
    with the batch: a step's memory does not depend on the values, and a large trial must not decode that many
    images or windows."""
    import torch

    return task.example_batch(splits.shape, batch, device, torch.Generator(device).manual_seed(batch))


def steady_steps(net, strategy, task, next_batch, device) -> dict[str, dict[str, int]]:
    """The device's peak in every part (PARTS) of the steps training repeats (STEPS, the first not counted),
    in each figure (PART_PEAKS): {figure: {part: bytes}}.

    The phases are cut where the code is, not where allocations are: the network's forward returning,
    the gradients being accumulated, the update applied; the device's high-water marks are read and reset
    at each cut.
    """
    from tula_hpc.training.step import accumulate_gradients, apply_update

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
            batch = next_batch()
            device_memory.reset_peak(device)
            cuts.clear()
            loss, reference_grads = accumulate_gradients(net, strategy, task, batch)
            cut("backward")
            apply_update(net, strategy, task, batch, reference_grads)
            cut("update")
            del batch, loss, reference_grads
            if kind != "first":
                for figure in PART_PEAKS:
                    for phase in PHASES:
                        part = f"{kind}/{phase}"
                        peaks[figure][part] = max(peaks[figure][part], cuts.get((figure, phase), 0))
    finally:
        handle.remove()
    return peaks


def measure_probe(job: Job, batch: int) -> dict:
    """One probe: the peak of every part of the steady steps at `batch` under the device budget, and
    the measured terms of Eq. 3 (parameters, gradients, optimiser state, saved activations, the batch)."""
    from torch.utils._pytree import tree_flatten

    from tula_hpc.training.loaders import prefetched_bytes
    from tula_hpc.training.strategies import build_strategy

    splits, model, task = build_probe_setup(job)
    device = probe_device(job)
    device_memory.limit(device, budget_bytes(job, device), model_bytes(model), job)
    strategy = build_strategy(model, job.train, batch, 1)
    peaks = steady_steps(model, strategy, task, lambda: shaped_batch(splits, task, batch, device), device)
    params = list(model.parameters())
    resident, param_bytes = model_bytes(model), sum(p.nbytes for p in params)
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    optimizer_bytes = optimizer_state_bytes(strategy.optimizer)
    # What else the steps left on the device (cuBLAS's and cuDNN's workspaces), read before the next batch exists.
    workspace_bytes = device_memory.in_use(device) - resident - grad_bytes - optimizer_bytes
    example = shaped_batch(splits, task, batch, device)
    activation_bytes, autocast_weight_bytes = saved_tensor_bytes(model, task.loss_of, example, strategy.precision)
    example_bytes = sum(t.nbytes for t in tree_flatten(example)[0])
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
        "batch_bytes": example_bytes,
        "loader_prefetch_bytes": prefetched_bytes(job, example_bytes),
    }


def trial_step(job: Job, batch: int, budget: int, ddp: bool) -> dict:
    """The steady steps at `batch` with the device limited to `budget`, as training runs them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tula_hpc.cluster.devices import join_one_rank_group
    from tula_hpc.training.strategies import build_strategy

    splits, model, task = build_probe_setup(job)
    device = probe_device(job)
    device_memory.limit(device, budget, model_bytes(model), job)
    net = model
    if ddp:  # a one-rank group gives the model DDP's gradient buckets, which every rank holds
        join_one_rank_group(device)
        net = DDP(model)
    strategy = build_strategy(net, job.train, batch, 1)
    peaks = steady_steps(net, strategy, task, lambda: shaped_batch(splits, task, batch, device), device)
    return {"batch": batch, "outcome": "fits", **{PEAK[f]: max(part_peaks.values()) for f, part_peaks in peaks.items()}}


def peak_fields(peaks: dict[str, dict[str, int]]) -> dict:
    """A probe's peaks per part and of the whole step, in every figure."""
    fields = {}
    for figure, part_peaks in peaks.items():
        fields[PEAK[figure]], fields[PART_PEAKS[figure]] = max(part_peaks.values()), part_peaks
    return fields


def run_in_fresh_process(kind: str, job: Job, **kwargs) -> dict:
    """`measure_probe` or `trial_step` of `job` in a new interpreter, the job crossing as its plain settings; its
    answer is the last line it prints."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job.resources.cpus_per_task)}
    proc = subprocess.run(
        [sys.executable, "-m", "tula_hpc.profiling.memory_probes", kind, json.dumps({"job": job.as_dict(), **kwargs})],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory {kind} at batch {kwargs['batch']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_in_this_process(kind: str, job: Job, **kwargs) -> dict:
    """`measure_probe` or `trial_step` here, then what it held is released for the next (as Lightning's and
    accelerate's batch-size searches do): no interpreter start-up and no kernels built again for each."""
    import torch.distributed as dist

    try:
        return _answer_in_process(kind, job, kwargs)
    finally:
        if dist.is_initialized():  # a trial's one-rank group
            dist.destroy_process_group()
        device_memory.release(probe_device(job))


def _answer_in_process(kind: str, job: Job, kwargs: dict) -> dict:
    """The probe's or trial's result with the allocator's events during it; running out of memory (or budget) is
    an answer, not a crash."""
    device = probe_device(job)
    before = device_memory.allocator_events(device)
    try:
        answer = {"measure": measure_probe, "trial": trial_step}[kind](job, **kwargs)
    except DeviceBudgetError as err:
        answer = {"batch": kwargs["batch"], "outcome": "budget_too_small", "error": str(err)}
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        answer = {
            "batch": kwargs["batch"],
            "outcome": "out_of_memory",
            "failed_at_bytes": device_memory.failed_at(device, err),
            "error": str(err)[:500],
        }
    after = device_memory.allocator_events(device)
    return {**answer, "allocator_events": {event: after[event] - before[event] for event in after}}


def main(argv: list[str] | None = None) -> int:
    kind, arguments = sys.argv[1:] if argv is None else argv
    kwargs = json.loads(arguments)
    with contextlib.redirect_stdout(sys.stderr):
        answer = _answer_in_process(kind, Job.from_dict(kwargs.pop("job")), kwargs)
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
