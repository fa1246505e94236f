"""Learning-rate maths, apart from the optimisers it drives: the peak rate (how it follows the global batch, by
strategy and optimiser: RATE_RULES) and the multiplier of it at every step (multistep: per-step linear warm-up, step
decay at epoch milestones; cosine: linear warm-up in steps, cosine decay to a floor at the run's last step).
A new scaling rule or schedule goes here. Torch-free: validation reads RATE_RULES without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from tula_hpc.core.job import WARMUP_RECIPES, recipe

if TYPE_CHECKING:
    from tula_hpc.core.job import TrainSettings

# How the peak rate follows the global batch B, by strategy and optimiser: "plain" (lr), "linear" (lr x B /
# lr_base_batch, Goyal et al.), "sqrt" (lr x sqrt(B / lr_base_batch), Malladi et al. 2022: Adam's square-root rule;
# betas and eps stay the recipe's), "recipe" (as the recipe of train.ags.base); any other text is why the pair is
# refused at validation. The one table of what each strategy does under each optimiser.
RATE_RULES = {
    "lbt": {"sgd": "plain", "adamw": "plain"},
    "lrs": {"sgd": "linear", "adamw": "sqrt"},
    "lars": {"sgd": "linear", "adamw": "sqrt"},  # LAMB under adamw (optimizers.py), You et al. 2020
    "polo": {"sgd": "plain", "adamw": "plain"},  # PostLocalSGDOptimizer wraps any optimiser
    "static": {"sgd": "recipe", "adamw": "recipe"},
    "ags": {"sgd": "recipe", "adamw": "recipe"},
    "adascale": {"sgd": "plain", "adamw": "plain"},  # its gain drives the rate: ADASCALE_RATE_POWER
}
RULES = ("plain", "linear", "sqrt", "recipe")
# The power of AdaScale's gain r the rate is multiplied by, by optimiser; its progress counts the full r either way.
# SGD: r (Johnson et al. 2020). Adam: r ** 0.5 (AdaptDL's AdamScale, petuum/adaptdl adaptdl/torch/scaling_rules.py),
# the square-root rule of Adam's rate in the batch (Malladi et al. 2022) applied to the gain, r being the batch's
# worth in base batches.
ADASCALE_RATE_POWER = {"sgd": 1.0, "adamw": 0.5}


def refusal(strategy: str, optimizer: str) -> str | None:
    """Why `strategy` cannot run under `optimizer` (RATE_RULES), or None when it can."""
    rule = RATE_RULES[strategy][optimizer]
    return None if rule in RULES else rule


def strategies_under(optimizer: str) -> list[str]:
    """The strategies that run under `optimizer`, for the message that refuses another."""
    return [strategy for strategy in RATE_RULES if refusal(strategy, optimizer) is None]


def peak_lr(train_cfg: TrainSettings, global_batch: int) -> float:
    """The learning rate after warm-up and before decay: scaled with the batch by the recipe's rule (RATE_RULES)."""
    rule = RATE_RULES[recipe(train_cfg)][train_cfg.optimizer]
    if rule == "linear":
        return train_cfg.lr * global_batch / train_cfg.lr_base_batch
    if rule == "sqrt":
        return train_cfg.lr * math.sqrt(global_batch / train_cfg.lr_base_batch)
    return train_cfg.lr


def lr_factor(train_cfg: TrainSettings, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak rate at optimiser step k (0-based), by train.lr_schedule's kind.

    multistep (the default): warm-up ramps (k + 1) / (warmup_epochs x steps_per_epoch) to 1, per step as in Goyal
    et al. (from peak / warm-up steps rather than their unscaled rate, so that it also applies to polo, whose rate is
    not scaled). Decay multiplies by lr_gamma at each of lr_milestones (epochs), as MultiStepLR stepped once per
    epoch does. cosine: see cosine_factor, over the run's `total_steps` (progress.run_steps).
    """
    schedule = train_cfg.lr_schedule
    if schedule.kind == "cosine":
        return cosine_factor(schedule.warmup_steps, total_steps, schedule.min_lr_ratio)
    warm_steps = train_cfg.warmup_epochs * steps_per_epoch if recipe(train_cfg) in WARMUP_RECIPES else 0
    milestones, gamma = train_cfg.lr_milestones, train_cfg.lr_gamma

    def factor(step: int) -> float:
        epoch = step // steps_per_epoch
        decay = gamma ** sum(epoch >= m for m in milestones)
        return decay * min(1.0, (step + 1) / warm_steps) if warm_steps else decay

    return factor


def cosine_factor(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """(k + 1) / warmup_steps over the first warmup_steps steps, then half a cosine from 1 down to min_ratio at step
    total_steps - 1, the run's last (GPT-3's and nanoGPT's schedule); min_ratio after it, should the run go on."""
    decay_steps = max(1, total_steps - 1 - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
