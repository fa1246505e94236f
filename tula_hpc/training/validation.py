"""Validation while training: which held-out samples it scores and at which steps. A language model's run is often
shorter than an epoch and its validation split long, so it validates every train.val_every_steps optimiser steps
(or every train.val_every_tokens tokens, whatever the batch) on train.val_samples of the split, the same seeded
subset every time so that the scores compare; the evaluate stage still scores every held-out sample.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset

from tula_hpc.training.step import evaluate_metrics


def validation_subset(dataset: Dataset, samples: int | None, seed: int) -> Dataset:
    """`samples` of `dataset` drawn with `seed` (in the split's order), the same on every rank and at every
    validation; the whole split when `samples` is None or not below its length."""
    if samples is None or samples >= len(dataset):
        return dataset
    drawn = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    return Subset(dataset, sorted(drawn.tolist()))


class Validation:
    """The run's validation: the task's scores on its subset, at the slice a device computes at once, under the
    training precision, and their headline in the task's words for the log."""

    def __init__(self, net, dataset: Dataset, ctx, task, loader_options: dict):
        self.net, self.dataset, self.ctx, self.task, self.loader_options = net, dataset, ctx, task, loader_options

    def scores(self, micro_batch: int, precision) -> dict[str, float]:
        return evaluate_metrics(
            self.net, self.dataset, self.ctx, self.task, micro_batch, precision, **self.loader_options
        )

    def headline(self, scores: dict[str, float]) -> str:
        metric = self.task.metrics[self.task.headline]
        return f"val {metric.label} {scores[self.task.headline]:.4f}{' ' + metric.unit if metric.unit else ''}"


def validation_due(train_cfg, step: int, tokens: tuple[int, int], epoch_over: bool) -> bool:
    """Whether optimiser step `step`, which trained from `tokens[0]` to `tokens[1]` (all ranks), validates mid-epoch:
    at every train.val_every_steps-th step, and where the tokens cross a multiple of train.val_every_tokens (once
    where both fall due); not where the epoch, or the run, is over, whose end validates anyway."""
    every_steps, every_tokens = train_cfg.val_every_steps, train_cfg.val_every_tokens
    by_steps = every_steps is not None and step % every_steps == 0
    by_tokens = every_tokens is not None and tokens[1] // every_tokens > tokens[0] // every_tokens
    return (by_steps or by_tokens) and not epoch_over
