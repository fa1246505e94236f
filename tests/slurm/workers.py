"""Functions the Slurm tests run as jobs (importable by module path on the compute nodes)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tula_hpc.cluster.distributed import init_distributed, shutdown
from tula_hpc.training.models import build_model


def all_reduce_for(seconds: float) -> int:
    """Keep every rank in collectives for `seconds`: a dead rank leaves the others waiting in one."""
    ctx = init_distributed(use_gpus=False)
    tensor = torch.ones(1)
    deadline = time.time() + seconds
    rounds = 0
    while time.time() < deadline:
        dist.all_reduce(tensor)
        tensor.fill_(1)
        rounds += 1
        time.sleep(0.05)
    shutdown()
    return ctx.world_size


def hang_the_first_time(marker: str, seconds: float) -> int:
    """Sleep `seconds` the first time (leaving `marker`), return at once after: a measurement that a time limit or a
    requeue interrupts, then taken again. Returns the Slurm job it ran in."""
    if not Path(marker).exists():
        Path(marker).write_text(os.environ["SLURM_JOB_ID"])
        time.sleep(seconds)
    return int(os.environ["SLURM_JOB_ID"])


def hold_memory(megabytes: int) -> int:
    block = bytearray(megabytes * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(2)
    return len(block)


def paced_tiny_cnn(num_classes: int, in_channels: int, image_size: int, seconds_per_step: float = 0.2) -> nn.Module:
    """tiny_cnn whose every training forward pass first sleeps `seconds_per_step` (asleep, not computing).

    Epochs then take about as long on any machine, so a time-limit test needs as many allocations anywhere;
    the weights and the arithmetic are tiny_cnn's.
    """
    model = build_model("tiny_cnn", {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size})
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds_per_step) if module.training else None)
    return model


def report_ranks() -> list[dict]:
    """Every rank's placement and device after one all_reduce: launch.run returns only rank 0's result.

    The ranks use their GPUs where CUDA works; on stand-in GPUs they compute on the CPU (a GPU job would stop:
    `gpu_rank_on_a_node_without_cuda`)."""
    ctx = init_distributed(use_gpus=torch.cuda.is_available())
    total = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(total)
    mine = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "env": {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
        "node_id": int(os.environ["SLURM_NODEID"]),
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": str(ctx.device),
        "cpus": len(os.sched_getaffinity(0)),  # the cores the rank may run on: under cgroup confinement, those asked
        "sum": total.item(),
    }
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    shutdown()
    return everyone


def gpu_rank_on_a_node_without_cuda() -> None:
    """A GPU job's rank where CUDA is unusable: it must stop on its node, naming the host and the CUDA there."""
    init_distributed(use_gpus=True)
