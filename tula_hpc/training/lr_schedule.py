"""Learning-rate maths, apart from the optimisers it drives: the peak rate (linear scaling with the global batch for
the lrs and lars recipes, Goyal et al.) and the multiplier of it at every step (per-step linear warm-up, step decay at
epoch milestones). A new scaling rule (square-root scaling for AdamW or LAMB) or schedule goes here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tula_hpc.core.job import LR_SCALING_RECIPES, WARMUP_RECIPES, recipe

if TYPE_CHECKING:
    from tula_hpc.core.job import TrainSettings


def peak_lr(train_cfg: TrainSettings, global_batch: int) -> float:
    """The learning rate after warm-up and before decay: linearly scaled for lrs and lars (and AGS on them)."""
    if recipe(train_cfg) in LR_SCALING_RECIPES:
        return train_cfg.lr * global_batch / train_cfg.lr_base_batch
    return train_cfg.lr


def lr_factor(train_cfg: TrainSettings, steps_per_epoch: int) -> Callable[[int], float]:
    """Multiplier of the peak rate at optimiser step k (0-based): linear warm-up, then step decay.

    Warm-up ramps (k + 1) / (warmup_epochs x steps_per_epoch) to 1, per step as in Goyal et al.
    (from peak / warm-up steps rather than their unscaled rate, so that it also applies to polo,
    whose rate is not scaled). Decay multiplies by lr_gamma at each of lr_milestones (epochs), as
    MultiStepLR stepped once per epoch does.
    """
    warm_steps = train_cfg.warmup_epochs * steps_per_epoch if recipe(train_cfg) in WARMUP_RECIPES else 0
    milestones, gamma = train_cfg.lr_milestones, train_cfg.lr_gamma

    def factor(step: int) -> float:
        epoch = step // steps_per_epoch
        decay = gamma ** sum(epoch >= m for m in milestones)
        return decay * min(1.0, (step + 1) / warm_steps) if warm_steps else decay

    return factor
