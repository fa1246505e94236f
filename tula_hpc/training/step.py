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
from tula_hpc.training.datasets import load_splits
from tula_hpc.training.loaders import make_eval_loader, on_device
from tula_hpc.training.models import build_model
from tula_hpc.training.optimizers import clip_gradients

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
    net: nn.Module, strategy, loss_fn, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1, sync: bool = True
) -> tuple[torch.Tensor, dict | None]:
    """Forward and backward of a step; returns the batch's mean loss and the reference sub-batch's gradients.

    With micro_batches > 1 the gradient is accumulated over that many slices of the batch, each loss
    weighted by its share: the same step (up to BatchNorm's per-slice statistics) with the activations
    of one slice, which is how training survives running out of memory without changing the global
    batch. Under DDP only the last slice synchronises, and none with sync=False (the profiler then
    all-reduces on its own clock). When the strategy asks for a reference sub-batch (AGS), it is
    accumulated first, and its own gradient is read off before the rest adds to it.

    The forward and loss run under the strategy's autocast; under fp16 the gradients are left multiplied
    by the loss scale (`apply_update` divides them), the reference gradients are returned divided by it.
    """
    precision = strategy.precision
    strategy.optimizer.zero_grad(set_to_none=True)
    reference = strategy.reference_indices(len(y))
    head, (x_main, y_main) = [], (x, y)
    if reference is not None:
        in_reference = torch.zeros(len(y), dtype=torch.bool, device=x.device)
        in_reference[reference.to(x.device)] = True
        head, (x_main, y_main) = [(x[in_reference], y[in_reference])], (x[~in_reference], y[~in_reference])
    slices = head + [
        (xs, ys) for xs, ys in zip(x_main.tensor_split(micro_batches), y_main.tensor_split(micro_batches)) if len(ys)
    ]
    losses, reference_grads = [], None
    for i, (xs, ys) in enumerate(slices):
        synchronise = sync and i == len(slices) - 1
        with contextlib.nullcontext() if synchronise or not isinstance(net, DDP) else net.no_sync():
            with precision.autocast():
                loss = loss_fn(net(precision.inputs(xs)), ys)
            if len(slices) > 1:
                loss = loss * (len(ys) / len(y))
            precision.backward(loss)
        losses.append(loss.detach())
        if reference is not None and i == 0:
            share = len(y) / len(ys) / precision.loss_scale()
            reference_grads = {p: p.grad * share for p in net.parameters() if p.grad is not None}
    return sum(losses[1:], losses[0]), reference_grads


def apply_update(net: nn.Module, strategy, loss_fn, x: torch.Tensor, y: torch.Tensor, reference_grads) -> None:
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
        strategy.before_step(net, loss_fn, x, y, reference_grads)
        strategy.optimizer.step()
    precision.update()
    strategy.after_step()


def training_step(
    net: nn.Module, strategy, loss_fn, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1
) -> torch.Tensor:
    """One optimiser step on the batch (x, y); returns the batch's mean loss (see `accumulate_gradients`)."""
    loss, reference_grads = accumulate_gradients(net, strategy, loss_fn, x, y, micro_batches)
    if strategy.noise_scale is not None:
        strategy.noise_scale.end_step(len(y), strategy.precision.scale_on_device())
    apply_update(net, strategy, loss_fn, x, y, reference_grads)
    return loss


def loop_step(
    net: nn.Module,
    strategy,
    loss_fn,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    stop,
    micro_batches=1,
) -> tuple[torch.Tensor, bool]:
    """The training loop's step, as training runs it and profiling times it: the stop-flag exchange
    (preemption.StopRequests, overlapped with the step and read after it), the batch's copy to the device and
    the optimiser step. Returns the batch's mean loss and whether a rank has been asked to stop."""
    stop.begin_step()
    x, y = on_device(batch, device)
    loss = training_step(net, strategy, loss_fn, x, y, micro_batches)
    return loss, stop.agreed()


def evaluate_accuracy(model: nn.Module, dataset, ctx: Context, batch_size: int = 256, **loader_options) -> float:
    """Top-1 accuracy over the whole data set, each rank scoring its own images, every image once
    (`loader_options`: loaders.loader_options, the job's workers and pinning)."""
    loader = make_eval_loader(dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, **loader_options)
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad():
        for batch in loader:
            x, y = on_device(batch, ctx.device)
            pred = model(x).argmax(1)
            counts[0] += (pred == y).sum()
            counts[1] += len(y)
    model.train()
    if ctx.world_size > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])
