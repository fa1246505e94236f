"""Scoring a trained model where the job's devices are (the evaluate stage's worker, launched by name so that the
stage, on a login node, imports no torch): the task's metrics (tasks.Task) at the trained per-device batch under the
training precision, with each metric's words, so that the report speaks the task's language without knowing its name.

A model with BatchNorm is scored with BatchNorm statistics recomputed over training samples with the final weights
("precise BN", Wu & Johnson 2021), and as trained. Running statistics are an exponential average over
training steps (momentum 0.01 in torchvision's MobileNetV3): after the few dozen steps of a large-batch
run they still describe early weights, and the as-trained score says little about the weights themselves.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset

from tula_hpc.cluster.distributed import Context, init_distributed, shutdown
from tula_hpc.core.atomic_files import atomic_path
from tula_hpc.training.datasets import load_splits
from tula_hpc.training.loaders import loader_options, make_eval_loader, on_device
from tula_hpc.training.models import build_model
from tula_hpc.training.precision import Precision
from tula_hpc.training.step import evaluate_metrics
from tula_hpc.training.tasks import Task, job_task

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# Precise BN's sample: thousands of samples estimate the statistics well, and the bound keeps evaluation's cost
# apart from the training set's size.
PRECISE_BN_SAMPLES = 8192


def recompute_batchnorm_statistics(
    model: nn.Module, dataset, ctx: Context, task: Task, *, seed: int = 0, batch_size: int = 256, **loader
) -> bool:
    """Precise BN: every BatchNorm's statistics become the average over PRECISE_BN_SAMPLES training samples (a
    seeded draw; all of them in a smaller set) with the final weights, the draw spread over the ranks, each
    rank passing its own share (loaded with `loader`, `loaders.loader_options`), the ranks' averages then averaged.

    Returns False (and leaves the model alone) when it has no BatchNorm."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return False
    momenta = [norm.momentum for norm in norms]
    model.eval()
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average over the rank's batches
        norm.train()
    drawn = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:PRECISE_BN_SAMPLES]
    share = make_eval_loader(
        Subset(dataset, drawn.tolist()), batch_size, rank=ctx.rank, world_size=ctx.world_size, **loader
    )
    with torch.no_grad():
        for batch in share:
            task.forward(model, on_device(batch, ctx.device))
    if ctx.world_size > 1:
        _average_over_ranks(norms)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    model.train()
    return True


def _average_over_ranks(norms: list[nn.Module]) -> None:
    """Each rank's statistics are averages over its batches: weighted by those batches, they average into the
    statistics of all ranks' batches, the same on every rank."""
    for norm in norms:
        batches = norm.num_batches_tracked.to(norm.running_mean.dtype).reshape(1)
        summed = torch.cat([norm.running_mean * batches, norm.running_var * batches, batches])
        dist.all_reduce(summed)
        mean, var, total = summed.split([len(norm.running_mean), len(norm.running_var), 1])
        norm.running_mean.copy_(mean / total)
        norm.running_var.copy_(var / total)
        norm.num_batches_tracked.fill_(int(total.item()))


def score(model: nn.Module, splits, ctx, dataset, task: Task, batch_size: int, precision, seed: int = 0, **loader):
    """The task's metrics on `dataset` after precise BN over the training split (the headline's), and as trained."""
    measure = functools.partial(evaluate_metrics, model, dataset, ctx, task, batch_size, precision, **loader)
    as_trained = measure()
    precise = recompute_batchnorm_statistics(model, splits.train, ctx, task, seed=seed, **loader)
    return (measure() if precise else as_trained), as_trained


def scored(task: Task, metrics: dict[str, float], as_trained: dict[str, float]) -> dict:
    """eval.json's scores: `test_<metric>` for every metric, the headline's `test_<headline>_as_trained`, and what
    the report needs to print them in the task's words."""
    return {
        **{f"test_{name}": value for name, value in metrics.items()},
        f"test_{task.headline}_as_trained": as_trained[task.headline],
        "task": task.name,
        "headline": task.headline,
        "sample_noun": task.sample_noun,
        "beside_headline": [name for name in task.metrics if name != task.headline]
        if task.beside_headline is None
        else list(task.beside_headline),
        "metrics": {
            name: {"label": metric.label, "unit": metric.unit, "higher_is_better": metric.higher_is_better}
            for name, metric in task.metrics.items()
        },
    }


def save_trained_model(path: Path, model: nn.Module, job: Job, splits) -> None:
    """The final model with what `load_trained_model` needs to rebuild it."""
    with atomic_path(path) as tmp:
        torch.save(
            {
                "model": model.state_dict(),
                "model_name": job.model.name,
                "model_kwargs": job.model.kwargs,
                "shape": splits.shape,
            },
            tmp,
        )


def load_trained_model(model_path: str | Path) -> nn.Module:
    """The network train/model.pt holds, built as training built it, on the CPU."""
    saved = torch.load(model_path, map_location="cpu", weights_only=False)
    shape = saved.get("shape") or {key: saved[key] for key in ("num_classes", "in_channels", "image_size")}
    model = build_model(saved["model_name"], shape, saved["model_kwargs"])
    model.load_state_dict(saved["model"])
    return model


def evaluate_worker(job: Job, model_path: str, per_device_batch: int = 256) -> dict:
    """The test set scored at the trained `per_device_batch` under the training precision (train.precision,
    train.channels_last)."""
    ctx = init_distributed(job.resources.gpus_per_node > 0)
    splits, task = load_splits(job.data, job.train.seed), job_task(job)
    model = load_trained_model(model_path).to(ctx.device)
    precision = Precision(job.train.precision, ctx.device, job.train.channels_last)
    options = loader_options(job, ctx.device)
    metrics, as_trained = score(
        model, splits, ctx, splits.test, task, per_device_batch, precision, seed=job.train.seed, **options
    )
    shutdown()
    return {**scored(task, metrics, as_trained), "test_samples": len(splits.test)}
