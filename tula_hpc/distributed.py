"""torch.distributed set-up inferred from the environment the launcher exported (RANK, WORLD_SIZE, ...)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .files import read_json, write_json

COLLECTIVE_TIMEOUT_S = float(os.environ.get("TULA_COLLECTIVE_TIMEOUT_S", "120"))
FAILURE_NOTE_WAIT_S = 10.0


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    """A process group that serves every tensor a rank hands it: NCCL for the GPU's, gloo for the CPU's.

    Not NCCL alone on GPUs: small bookkeeping collectives (profiling's interference, object gathers) hold CPU
    tensors, which a NCCL-only group has no backend for.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed(use_gpus: bool) -> Context:
    """Join the process group (`backend_for` the rank's device); a single process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_gpus and torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    return Context(rank, world_size, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def post_failure(folder: str | Path, rank: int, note: dict) -> None:
    """Tell the other ranks why this rank stops, before it leaves the collectives they wait in.

    A rank that fails mid-step (out of memory in backward) cannot finish the collectives its peers
    already started; once it exits, its connections close and each peer's pending collective fails at
    once. The peer then reads this note (`peer_failure`) instead of taking the error for a lost node.
    """
    write_json(Path(folder) / f"rank{rank}.json", note)


def peer_failure(folder: str | Path, wait_s: float = FAILURE_NOTE_WAIT_S) -> dict | None:
    """The note of a rank that stopped, if one appears in `folder` within `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        notes = sorted(Path(folder).glob("rank*.json"))
        if notes:
            return read_json(notes[0])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
