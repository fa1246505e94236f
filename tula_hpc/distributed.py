"""torch.distributed set-up inferred from the environment the launcher exported (RANK, WORLD_SIZE, ...)."""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from .files import read_json, write_json

COLLECTIVE_TIMEOUT_S = float(os.environ.get("TULA_COLLECTIVE_TIMEOUT_S", "120"))
FAILED_RANK_EXIT = 3  # a rank ended the job step on purpose (see end_job_step)


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
        # One rank per GPU of its node; the local launcher's "nodes" share this machine's GPUs in turn.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
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


def end_job_step(folder: str | Path, rank: int, note: dict) -> NoReturn:
    """Record why this rank stops, then end the whole job step at once, under any backend.

    The peers of a rank that fails mid-step (out of memory in backward) wait in collectives it will never
    join: gloo's fail when its connections close, NCCL's hang until a watchdog fires. So no rank waits to
    learn of it: this one exits non-zero, and `srun --kill-on-bad-exit` (Slurm) or the local launcher ends
    every other rank. The stage then reads the record (`failure_records`) and decides what comes next.
    """
    write_json(Path(folder) / f"rank{rank}.json", {**note, "rank": rank, "recorded_at": time.time()})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_RANK_EXIT)


def failure_records(folder: str | Path) -> list[dict]:
    """What the ranks that ended a job step recorded, by rank."""
    return [read_json(path) for path in sorted(Path(folder).glob("rank*.json"))]
