"""How a configuration lays ranks and samples out: who shares a machine, how an epoch is cut into steps.

Plain arithmetic that planning, profiling, the performance model and training must agree on.
"""

from __future__ import annotations

import math


def devices_per_node(job: dict) -> int:
    """Ranks per node: one per GPU, or one CPU rank on a node without GPUs."""
    return max(1, job["resources"]["gpus_per_node"])


def ranks_per_host(launcher: str, nodes: int, devices_per_node: int) -> int:
    """Ranks that share one machine: the local launcher runs every "node" on this one."""
    return nodes * devices_per_node if launcher == "local" else devices_per_node


def steps_per_epoch(train_samples: int, ranks: int, per_device_batch: int) -> int:
    """As DistributedSampler + DataLoader(drop_last=False) do it: each rank's share, in batches."""
    return math.ceil(math.ceil(train_samples / ranks) / per_device_batch)


def last_batch(train_samples: int, ranks: int, per_device_batch: int) -> int:
    """Per-device size of an epoch's last step (the rest of each rank's share)."""
    share = math.ceil(train_samples / ranks)
    return share - (steps_per_epoch(train_samples, ranks, per_device_batch) - 1) * per_device_batch
