"""The learning rate: linear scaling with the batch, per-step warm-up, and the epoch milestones' decay."""

from __future__ import annotations

import pytest

from tests.conftest import default_job
from tula_hpc.training.lr_schedule import lr_factor, peak_lr


def _rates(train: dict, global_batch: int, steps_per_epoch: int, steps: int) -> list[float]:
    """The rate at each of the first `steps` optimiser steps of a job with train settings `train`."""
    train_cfg = default_job(train=train).train
    factor = lr_factor(train_cfg, steps_per_epoch)
    return [peak_lr(train_cfg, global_batch) * factor(step) for step in range(steps)]


def test_lrs_scales_linearly_and_warms_up_per_step():
    train = dict(strategy="lrs", lr=0.05, lr_base_batch=128, warmup_epochs=2, lr_milestones=[3], lr_gamma=0.1)
    peak = 0.05 * 512 / 128
    expected = [peak * (k + 1) / 8 for k in range(8)] + [peak] * 4 + [peak * 0.1] * 4
    assert _rates(train, global_batch=512, steps_per_epoch=4, steps=16) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["lbt", "ags"])
def test_strategies_without_warm_up_keep_the_epoch_milestones(name):
    train = dict(strategy=name, lr=0.05, lr_milestones=[1, 2], lr_gamma=0.5)
    rates = _rates(train, global_batch=512, steps_per_epoch=3, steps=9)
    assert rates == pytest.approx([0.05] * 3 + [0.025] * 3 + [0.0125] * 3)
