"""The learning rate: linear and square-root scaling with the batch, per-step warm-up, the epoch milestones' decay and
the cosine schedule in steps."""

from __future__ import annotations

import math

import pytest

from tests.conftest import default_job
from tula_hpc.training.lr_schedule import lr_factor, peak_lr


def _rates(train: dict, global_batch: int, steps_per_epoch: int, steps: int) -> list[float]:
    """The rate at each of the first `steps` optimiser steps of a job with train settings `train`."""
    train_cfg = default_job(train=train).train
    factor = lr_factor(train_cfg, steps_per_epoch, train_cfg.epochs * steps_per_epoch)
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


def test_lrs_under_adamw_scales_by_the_square_root_of_the_batch_ratio_and_lbt_not_at_all():
    adamw = dict(optimizer="adamw", lr=1e-3, lr_base_batch=64, warmup_epochs=0)
    assert _rates({**adamw, "strategy": "lrs"}, global_batch=256, steps_per_epoch=2, steps=1) == pytest.approx([2e-3])
    assert _rates({**adamw, "strategy": "lbt"}, global_batch=256, steps_per_epoch=2, steps=1) == pytest.approx([1e-3])


@pytest.mark.parametrize("strategy", ["ags", "static"])
def test_scaling_under_adamw_takes_its_base_recipes_rate(strategy):
    """On sgd (lbt's recipe) the plain rate, on lrs its square-root rule."""
    adamw = dict(optimizer="adamw", strategy=strategy, lr=1e-3, lr_base_batch=64, warmup_epochs=0)
    for base, rate in [("sgd", 1e-3), ("lrs", 2e-3)]:
        train = {**adamw, "ags": {"base": base}}
        assert _rates(train, global_batch=256, steps_per_epoch=2, steps=1) == pytest.approx([rate])


def test_cosine_warms_up_in_steps_then_decays_to_the_floor_at_the_last_step():
    schedule = {"kind": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1}
    train = dict(strategy="lbt", lr=1.0, epochs=3, lr_schedule=schedule)
    rates = _rates(train, global_batch=128, steps_per_epoch=5, steps=16)  # 15 steps: warm 0-3, decay 4-14
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[4] == pytest.approx(1.0)
    assert rates[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))  # half way: 0.55
    assert rates[14] == pytest.approx(0.1) and rates[15] == pytest.approx(0.1)


def test_cosine_ignores_the_epoch_warm_up_and_milestones():
    schedule = {"kind": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.0}
    train = dict(strategy="lrs", lr=0.1, lr_base_batch=128, epochs=2, warmup_epochs=1, lr_milestones=[1])
    rates = _rates({**train, "lr_schedule": schedule}, global_batch=128, steps_per_epoch=3, steps=6)
    assert rates == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(6)])
