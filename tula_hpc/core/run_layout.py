"""How a configuration lays ranks and samples out: who shares a machine, how an epoch is cut into steps.

Plain arithmetic that planning, profiling, the performance model and training must agree on.
"""

from __future__ import annotations

import math

from tula_hpc.core.job import Job


def doublings(low: int, high: int) -> list[int]:
    """`low` and its doublings up to `high`: a grid axis of nodes, GPUs per node or batches."""
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return values


def devices_per_node(job: Job) -> int:
    """Ranks per node: one per GPU, or one CPU rank on a node without GPUs."""
    return max(1, job.resources.gpus_per_node)


def candidate_devices(candidate: dict, job: Job) -> int:
    """Ranks per node of one candidate: its own GPUs per node (search.gpus_per_node makes it a choice), else the
    job's; a plan made before that choice existed has no such key."""
    gpus = candidate.get("gpus_per_node")
    return devices_per_node(job) if gpus is None else max(1, gpus)


def node_shape(candidate: dict, nodes: str = "{} node(s)") -> str:
    """How a candidate's nodes look, for people: "2 node(s) x 4 GPU(s)", or "2 node(s)" of one CPU rank each;
    `nodes` formats the node count ("N={}" gives "N=2 x 4 GPU(s)")."""
    gpus = candidate.get("gpus_per_node")
    return nodes.format(candidate["nodes"]) + (f" x {gpus} GPU(s)" if gpus else "")


def configuration(candidate: dict) -> dict:
    """The configuration a candidate (or a record of one) names: its nodes, GPUs per node where recorded, global
    batch; what the choice, the confirming search and their records compare and keep."""
    return {k: candidate[k] for k in ("nodes", "gpus_per_node", "batch") if k in candidate}


def profile_name(candidate: dict, job: Job) -> str:
    """A candidate's profile file stem: N{n}_B{b} at the job's own GPUs per node (as before GPUs per node was a
    choice, so nothing profiled then changes name), N{n}_G{g}_B{b} at any other."""
    gpus = candidate.get("gpus_per_node", job.resources.gpus_per_node)
    shape = "" if gpus == job.resources.gpus_per_node else f"_G{gpus}"
    return f"N{candidate['nodes']}{shape}_B{candidate['batch']}"


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
