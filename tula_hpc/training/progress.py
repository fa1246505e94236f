"""What the gradient noise scale (noise_scale.py measures it) means for training's progress: AdaScale's gain,
the steps of the user's recipe, the steps another batch needs to make the same progress, and the noise scale the
profiles measured. No torch here: the plan, fit-model, select and adapt stages read it on a login node.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tula_hpc.core.job import DataSettings, TrainSettings


def adascale_gain(gradient_sq, trace_at_base, scale):
    """AdaScale's gain r = (sigma^2 + |G|^2) / (sigma^2 / s + |G|^2) (Johnson et al., ICML 2020): how many steps of the
    base batch one step at s times it is worth. sigma^2 = tr(Sigma) / B_base, the gradient's variance at the base
    batch; r runs from 1 (no noise: a larger batch buys nothing) to s (all noise: s base steps at once). Equal to
    McCandlish's (1 + B_noise / B_base) / (1 + B_noise / B)."""
    return (trace_at_base + gradient_sq) / (trace_at_base / scale + gradient_sq)


def tokens_per_sample(data: DataSettings) -> int:
    """What train.tokens counts per sample: data.seq_len tokens, 1 where it is unset (images)."""
    return data.seq_len or 1


def run_epochs(train_cfg: TrainSettings, train_samples: int, global_batch: int, tokens_per_sample: int) -> float:
    """The run's length in epochs, the last one possibly part-run: train.tokens over the tokens of an epoch
    (tokens_per_sample x train_samples), train.steps of `global_batch` samples over the epoch's samples, else
    train.epochs. The one place a run's length is read: the trainer stops there, the cosine schedule ends there, and
    fit-model and select predict it."""
    if train_cfg.tokens is not None:
        return train_cfg.tokens / (tokens_per_sample * train_samples)
    if train_cfg.steps is not None:
        return train_cfg.steps * global_batch / train_samples
    return float(train_cfg.epochs)


def whole_epochs(epochs: float) -> int:
    """The epochs a run of `epochs` starts: its last one part-run (rounded off first: 3.0000000001 is 3)."""
    return max(1, math.ceil(round(epochs, 9)))


def run_steps(
    train_cfg: TrainSettings, train_samples: int, global_batch: int, tokens_per_sample: int, steps_per_epoch: int
) -> int:
    """The run's optimiser steps at `steps_per_epoch` (a rank's): train.steps as given, else `run_epochs`' epochs of
    steps, the last part-run epoch rounded up to a whole step."""
    if train_cfg.steps is not None:
        return train_cfg.steps
    epochs = run_epochs(train_cfg, train_samples, global_batch, tokens_per_sample)
    return whole_epochs(epochs * steps_per_epoch)


def recipe_steps(train_cfg: TrainSettings, train_samples: int, tokens_per_sample: int = 1) -> int:
    """The steps of the user's recipe, its run (`run_steps`: train.tokens, train.steps or train.epochs) at
    train.lr_base_batch: the progress AdaScale and the goodput objectives train to."""
    base = train_cfg.lr_base_batch
    return run_steps(train_cfg, train_samples, base, tokens_per_sample, math.ceil(train_samples / base))


def steps_to_progress(base_steps: float, b_noise: float, base_batch: int, batch: int) -> float:
    """Steps at `batch` that make the progress of `base_steps` at `base_batch`: S(B) = S_min (1 + B_noise / B)
    (McCandlish et al.), so base_steps x (1 + B_noise / B) / (1 + B_noise / B_base)."""
    return base_steps * (1 + b_noise / batch) / (1 + b_noise / base_batch)


def measured_noise_scale(profiles: list[dict]) -> dict | None:
    """The noise scale the profiles measured: the median B_noise over those that have one (multi-rank ones)."""
    values = sorted(p["noise_scale"]["b_noise"] for p in profiles if (p.get("noise_scale") or {}).get("b_noise"))
    if not values:
        return None
    return {"b_noise": statistics.median(values), "profiles": len(values), "range": [values[0], values[-1]]}
