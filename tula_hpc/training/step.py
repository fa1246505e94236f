"""The training step and its set-up, one copy for every stage that runs it.

Training runs it for real, profiling times it (so the performance model predicts what training does),
memory probing measures its peak (so the memory model sizes what training allocates), and evaluation
scores the trained model the way training scores validation. The step runs at the strategy's precision
(precision.Precision: autocast, fp16's loss scaling, memory format), so all three measure the same step.
Its clocks (`clock_for`) too: kernels run asynchronously on a GPU, so a host clock read before the device is
done would miss the work still queued.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tula_hpc.cluster.distributed import Context, seed_everything
from tula_hpc.training import tasks
from tula_hpc.training.datasets import load_splits
from tula_hpc.training.loaders import make_eval_loader, on_device
from tula_hpc.training.models import build_model
from tula_hpc.training.optimizers import clip_gradients
from tula_hpc.training.precision import Precision
from tula_hpc.training.tasks import Task

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


class Clock:
    """Marks on the host's clock: on the CPU the work is done when the call that does it returns."""

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self) -> None:
        """Until the work queued so far is done (on the CPU it is)."""

    def seconds(self, spans: list[tuple]) -> list[float]:
        """The time of each (start mark, end mark), once the work before the last mark is done."""
        return [end - start for start, end in spans]


class CudaClock(Clock):
    """Marks are CUDA events on the current stream, reached when the GPU has done the work queued before them."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, spans: list[tuple]) -> list[float]:
        self.wait()
        return [start.elapsed_time(end) / 1e3 for start, end in spans]


def clock_for(device: torch.device) -> Clock:
    """The step's clock on `device`; its `wait` is how a stage waits for the device before it reads a host clock
    (profiling's steps, training's epochs)."""
    return CudaClock(device) if device.type == "cuda" else Clock()


def build_for_job(job: Job, ctx: Context):
    """Data splits and the model on this rank's device (channels_last if train.channels_last), seeded so every
    rank starts identical."""
    seed_everything(job.train.seed)
    splits = load_splits(job.data, job.train.seed)
    model = build_model(job.model.name, splits.shape, job.model.kwargs)
    layout = torch.channels_last if job.train.channels_last else torch.preserve_format
    return splits, model.to(ctx.device, memory_format=layout)


def wrap_ddp(model: nn.Module, ctx: Context) -> nn.Module:
    if ctx.world_size == 1:
        return model
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def accumulate_gradients(
    net: nn.Module, strategy, task: Task, batch, micro_batches: int = 1, sync: bool = True
) -> tuple[torch.Tensor, dict | None]:
    """Forward and backward of a step; returns the batch's mean loss and the reference sub-batch's gradients.

    With micro_batches > 1 the gradient is accumulated over that many slices of the batch, each slice's mean
    loss weighted by its count (what the task's loss averages: images, tokens that count) over the batch's: the
    same gradient as the one big batch's (up to BatchNorm's per-slice statistics) with the activations of one
    slice, which is how training survives running out of memory without changing the global batch. The counts
    stay device tensors (no host sync). Under DDP only the last slice synchronises, and none with sync=False (the
    profiler then all-reduces on its own clock). When the strategy asks for a reference sub-batch (AGS), it is
    accumulated first, and its own gradient is read off before the rest adds to it.

    The forward and loss run under the strategy's autocast; under fp16 the gradients are left multiplied
    by the loss scale (`apply_update` divides them), the reference gradients are returned divided by it.
    """
    precision = strategy.precision
    strategy.optimizer.zero_grad(set_to_none=True)
    size = tasks.batch_size(batch)
    reference = strategy.reference_indices(size)
    head, rest = [], batch
    if reference is not None:
        in_reference = torch.zeros(size, dtype=torch.bool, device=reference.device)
        in_reference[reference] = True
        head, rest = [tasks.select(batch, in_reference)], tasks.select(batch, ~in_reference)
    slices = head + tasks.split(rest, micro_batches)
    total = task.count(batch).clamp(min=1) if len(slices) > 1 else None
    losses, reference_grads = [], None
    for i, part in enumerate(slices):
        synchronise = sync and i == len(slices) - 1
        with contextlib.nullcontext() if synchronise or not isinstance(net, DDP) else net.no_sync():
            with precision.autocast():
                loss, count = task.loss_of(net, precision.inputs(part))
            if total is not None:
                loss = loss * (count / total)
            precision.backward(loss)
        losses.append(loss.detach())
        if reference is not None and i == 0:
            share = total / count.clamp(min=1) / precision.loss_scale()
            reference_grads = {p: p.grad * share for p in net.parameters() if p.grad is not None}
    return sum(losses[1:], losses[0]), reference_grads


def apply_update(net: nn.Module, strategy, task: Task, batch, reference_grads) -> None:
    """The strategy's hooks around the optimiser step, on the accumulated (synchronised) gradient.

    The gradient is unscaled first (fp16), so the hooks (AGS's factors) and the optimiser (AGS's Delta) see
    true values, then clipped to train.grad_clip's global norm. A non-finite fp16 gradient skips the hooks and the
    optimiser, as GradScaler.step does: AGS neither counts the step nor takes a Delta or factors from it (a due
    update waits for the next step), and the scaler lowers its scale. The learning-rate schedule still advances
    (`Strategy.after_step`).
    """
    precision = strategy.precision
    if precision.unscale(strategy.optimizer):
        clip_gradients(net.parameters(), strategy.grad_clip)
        strategy.before_step(net, task.loss_of, batch, reference_grads)
        strategy.optimizer.step()
    precision.update()
    strategy.after_step()


def training_step(net: nn.Module, strategy, task: Task, batch, micro_batches: int = 1) -> torch.Tensor:
    """One optimiser step on `batch` (a pair or a dict of tensors on the device); returns its mean loss (see
    `accumulate_gradients`). The noise scale counts samples: see `NoiseScaleHook.end_step`."""
    loss, reference_grads = accumulate_gradients(net, strategy, task, batch, micro_batches)
    if strategy.noise_scale is not None:
        strategy.noise_scale.end_step(tasks.batch_size(batch), strategy.precision.scale_on_device())
    apply_update(net, strategy, task, batch, reference_grads)
    return loss


def loop_step(
    net: nn.Module, strategy, task: Task, batch, device: torch.device, stop, micro_batches=1
) -> tuple[torch.Tensor, bool]:
    """The training loop's step, as training runs it and profiling times it: the stop-flag exchange
    (preemption.StopRequests, overlapped with the step and read after it), the batch's copy to the device and
    the optimiser step. Returns the batch's mean loss and whether a rank has been asked to stop."""
    stop.begin_step()
    loss = training_step(net, strategy, task, on_device(batch, device), micro_batches)
    return loss, stop.agreed()


def evaluate_metrics(
    model: nn.Module, dataset, ctx: Context, task: Task, batch_size: int = 256, precision=None, **loader_options
) -> dict[str, float]:
    """The task's metrics over the whole data set, each rank scoring its own samples, every sample once, their
    sums and counts added over the ranks; under `precision` (the training's autocast and memory format) if given
    (`loader_options`: loaders.loader_options, the job's workers and pinning)."""
    loader = make_eval_loader(dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, **loader_options)
    precision = precision or Precision("fp32", ctx.device)
    sums, names = None, []
    model.eval()
    with torch.no_grad():
        for batch in loader:
            batch = on_device(batch, ctx.device)
            with precision.autocast():
                parts = task.metric_sums(task.forward(model, precision.inputs(batch)), batch)
            names = list(parts)
            summed = torch.stack([torch.stack([total.double(), count.double()]) for total, count in parts.values()])
            sums = summed if sums is None else sums + summed
    model.train()
    if sums is None:
        raise ValueError(f"no samples to score ({len(dataset)} in the data set)")
    if ctx.world_size > 1:
        dist.all_reduce(sums)
    return task.metric_values({name: (float(s), float(c)) for name, (s, c) in zip(names, sums.tolist())})
