"""torch.distributed set-up inferred from the environment the launcher exported (RANK, WORLD_SIZE, ...)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tula_hpc.cluster.devices import backend_for, rank_gpu

# How long a collective may wait for its peers before the group gives up (under NCCL, its watchdog then ends
# the job): short, so that a rank that died or hangs is noticed soon.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TULA_COLLECTIVE_TIMEOUT_S", "120"))
# How long the other ranks may wait for rank 0's work alone (writing a checkpoint to a slow file system):
# longer than any collective should take, so they wait for it in `wait_for_main`, never in a collective.
MAIN_ONLY_TIMEOUT_S = float(os.environ.get("TULA_MAIN_ONLY_TIMEOUT_S", "1800"))


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(use_gpus: bool) -> Context:
    """Join the process group (`backend_for` the rank's device); a single process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_gpus:
        # One rank per GPU of its node (the local launcher's "nodes" each have GPUs of this machine's own).
        device = torch.device("cuda", rank_gpu(local_rank))
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
        _join_main_only_group()
    return Context(rank, world_size, local_rank, device)


_main_only_group: dist.ProcessGroup | None = None


def _join_main_only_group() -> None:
    """A gloo group with MAIN_ONLY_TIMEOUT_S, made once with the default group (every rank makes it at once)."""
    global _main_only_group
    _main_only_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=MAIN_ONLY_TIMEOUT_S))


def wait_for_main() -> None:
    """Every rank waits here for rank 0's work alone (a checkpoint) before the next collective.

    In a collective the waiting ranks would have COLLECTIVE_TIMEOUT_S, and under NCCL work enqueued that its
    watchdog ends the job over; this is a CPU barrier on the long-timeout gloo group, with no NCCL work.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=_main_only_group)


def shutdown() -> None:
    global _main_only_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _main_only_group = None


def mean_over_ranks(value: torch.Tensor, ctx: Context) -> float:
    """A scalar averaged over every rank (every rank must call it): what an epoch's record says for all of them."""
    value = value.detach().clone()
    if ctx.world_size > 1:
        dist.all_reduce(value)
        value /= ctx.world_size
    return float(value)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
