"""One checkpoint dict (model, optimiser with the strategy's state, epoch, step, sampler position, RNG states,
config), written atomically by rank 0. The learning-rate schedule is not saved: it follows from the step
(Strategy.resume)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from .files import atomic_path


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    step: int,
    config: dict,
    samples_in_epoch: int = 0,
    extra: dict | None = None,
) -> None:
    """`epoch` is the number of finished epochs: training resumes at that epoch index, from each rank's
    `samples_in_epoch`-th sample of it (0 at an epoch's end; more when a preempted run stopped mid-epoch)."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "samples_in_epoch": samples_in_epoch,
        "rng": rng_state(),
        "config": config,
        "extra": extra or {},
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path) -> dict | None:
    if not Path(path).exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
