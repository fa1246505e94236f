"""One checkpoint dict (model, optimiser with the strategy's state, epoch, step, sampler position, every rank's
RNG states, config), written atomically by rank 0. The learning-rate schedule is not saved: it follows from the step
(Strategy.resume)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .files import atomic_path

# The checkpoint's layout; a training run resumes only from its own (RNG states by rank since 2, the gradient
# noise scale's averages and the strategy's own state, adascale's progress, since 3).
CHECKPOINT_FORMAT = 3


def rng_state() -> dict:
    """This process's generators; of CUDA's only its own GPU's (the current device), and only where it already uses
    CUDA: asking every visible GPU would make a CUDA context on each of them, from every rank (CPU jobs too)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def rng_states(world_size: int) -> list[dict] | None:
    """Every rank's RNG states, by rank, on rank 0 (None elsewhere); every rank calls it, as it is a collective.

    A rank's generators are its own: its GPU's draws (dropout) differ from the other ranks'. An object gather,
    which runs on the CPU (gloo) under a "cpu:gloo,cuda:nccl" group too.
    """
    if world_size == 1:
        return [rng_state()]
    states = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(), states, dst=0)
    return states


def own_rng_state(states: list[dict], rank: int, world_size: int) -> dict:
    """This rank's states from a checkpoint's `rng_states`; rank 0's for every rank when the world size changed
    (a relaunch on another number of ranks: saved ranks and these ranks no longer match)."""
    if len(states) == world_size:
        return states[rank]
    if rank == 0:
        print(
            f"[checkpoint] saved by {len(states)} ranks, resumed by {world_size}: "
            "every rank restores rank 0's RNG states",
            flush=True,
        )
    return states[0]


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    step: int,
    config: dict,
    rng: list[dict],
    samples_in_epoch: int = 0,
    extra: dict | None = None,
) -> None:
    """`epoch` is the number of finished epochs: training resumes at that epoch index, from each rank's
    `samples_in_epoch`-th sample of it (0 at an epoch's end; more when a preempted run stopped mid-epoch).
    `rng`: every rank's RNG states, by rank (`rng_states`)."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "samples_in_epoch": samples_in_epoch,
        "rng": rng,
        "config": config,
        "extra": extra or {},
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path) -> dict | None:
    if not Path(path).exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
