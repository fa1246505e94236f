"""One checkpoint dict (model, optimiser, the run's state: epoch, step, sampler position, clocks, the strategy's and
the noise estimator's state; every rank's RNG states; what run it belongs to), written atomically by rank 0
(`Checkpointer`). The learning-rate schedule is not saved: it follows from the step (Strategy.resume)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tula_hpc.core.atomic_files import atomic_path

# The checkpoint's layout; a training run resumes only from its own (RNG states by rank since 2, the gradient
# noise scale's averages and the strategy's own state, adascale's progress, since 3; one `state` entry since 4).
CHECKPOINT_FORMAT = 4


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


@dataclass
class TrainState:
    """Everything of the run that resumes beside the model and the optimiser, as its checkpoint keeps it: finished
    epochs, samples per rank into the next one (the sampler's position), steps, the finished epochs' time and the
    open epoch's time, data wait, loss (summed over its steps, every rank's mean) and steps so far (saved part-way:
    mid-epoch, or its steps done before its end), the steps it restarted at, the epochs' records, the strategy's and
    the noise estimator's own state (filled in when saving), and the batch schedule's place."""

    epoch: int = 0
    samples_done: int = 0
    step: int = 0
    train_time: float = 0.0
    open_epoch_time: float = 0.0
    open_epoch_data_wait: float = 0.0
    open_epoch_loss_sum: float = 0.0
    open_epoch_steps: int = 0
    restarts: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    strategy: dict = field(default_factory=dict)
    noise_scale: dict | None = None
    global_batch: int | None = None  # the batch in effect, once train.batch_schedule adaptive or ramp changed it
    batch_changed_at: int | None = None  # the optimiser step after which it last changed
    optimizer_steps: int = 0  # every step taken, at whichever batch (`step` places the schedule at the current one)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class CheckpointUnreadable(RuntimeError):
    """Neither the checkpoint nor the one before it can be read; the message names them and what to do."""


def previous_path(path: Path) -> Path:
    """Where the checkpoint a save replaces is kept (checkpoint.previous.pt beside checkpoint.pt)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def save_checkpoint(path: Path, checkpoint: dict) -> None:
    """The one checkpoint dict, written atomically (a kill mid-write leaves the last one whole); the one it replaces
    is kept as the previous checkpoint, to resume from should this one be damaged later (truncated, corrupted)."""
    with atomic_path(path) as tmp:
        torch.save(checkpoint, tmp)
        if Path(path).exists():
            os.replace(path, previous_path(path))


def load_checkpoint(path: Path) -> dict | None:
    """The newest checkpoint that can be read: the previous one where the last cannot; None where there is none."""
    found = newest_readable(path)
    return None if found is None else found[1]


def newest_readable(path: Path) -> tuple[Path, dict] | None:
    """(the file read, its checkpoint): `path`, or the previous checkpoint where `path` cannot be read; None where
    there is none; CheckpointUnreadable where neither can be read."""
    damaged = []
    for candidate in (Path(path), previous_path(path)):
        if not candidate.exists():
            continue
        try:
            checkpoint = torch.load(candidate, map_location="cpu", weights_only=False)
        except Exception as err:  # a damaged file fails in the zip reader, the unpickler or the storage reader
            damaged.append(f"{candidate} ({type(err).__name__}: {str(err)[:200]})")
            continue
        if damaged:
            print(f"[checkpoint] cannot read {damaged[0]}: resuming from {candidate}", flush=True)
        return candidate, checkpoint
    if damaged:
        raise CheckpointUnreadable(
            f"no checkpoint of this run can be read: {'; '.join(damaged)}. Delete {path} and "
            f"{previous_path(path)} to train this run from its start, or put back a copy of one of them."
        )
    return None


class Checkpointer:
    """Saving and loading one run's checkpoint, and the check that a checkpoint belongs to it.

    The checkpoint is one dict: model, optimiser, the run's state (TrainState: epoch, step, sampler position,
    clocks, history, the strategy's and the noise estimator's state), every rank's RNG states, and `run`, what the
    checkpoint must match (settings, selection, this layout's CHECKPOINT_FORMAT). Only rank 0 writes; the others wait
    for it outside any collective (a checkpoint may outlast the collective timeout).
    """

    def __init__(self, path: Path, run: dict, ctx) -> None:
        self.path, self.run, self.ctx = Path(path), run, ctx
        self.loaded_from: Path | None = None  # the file `load` read: the previous checkpoint where the last is damaged

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> float:
        """Every rank hands rank 0 its RNG states (a collective), rank 0 writes, every rank waits for it. Returns its
        seconds, the device's queued work left out: what a stop before the time limit must leave time for."""
        from tula_hpc.cluster.distributed import wait_for_main

        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        started = time.perf_counter()
        rng = rng_states(self.ctx.world_size)
        if self.ctx.is_main:
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "state": state,
                "rng": rng,
                "run": self.run,
            }
            save_checkpoint(self.path, checkpoint)
        wait_for_main()
        return time.perf_counter() - started

    def load(self) -> dict | None:
        """The checkpoint of this run, or None (none yet, or one of another configuration, which is left alone)."""
        found = newest_readable(self.path)
        if found is None:
            return None
        self.loaded_from, checkpoint = found
        if checkpoint.get("run") != self.run:
            if self.ctx.is_main:
                print(f"[train] ignoring checkpoint {self.path}: it belongs to a different configuration", flush=True)
            return None
        return checkpoint
