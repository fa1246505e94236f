"""Validation while training: which held-out samples it scores and at which steps. A language model's run is often
shorter than an epoch and its validation split long, so it validates every train.val_every_steps optimiser steps
on train.val_samples of the split, the same seeded subset every time so that the scores compare; the evaluate stage
still scores every held-out sample.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset


def validation_subset(dataset: Dataset, samples: int | None, seed: int) -> Dataset:
    """`samples` of `dataset` drawn with `seed` (in the split's order), the same on every rank and at every
    validation; the whole split when `samples` is None or not below its length."""
    if samples is None or samples >= len(dataset):
        return dataset
    drawn = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    return Subset(dataset, sorted(drawn.tolist()))


def validation_due(every: int | None, step: int, epoch_over: bool) -> bool:
    """Whether optimiser step `step` validates mid-epoch (train.val_every_steps `every`): not where the epoch, or the
    run, is over, whose end validates anyway."""
    return every is not None and step % every == 0 and not epoch_over
