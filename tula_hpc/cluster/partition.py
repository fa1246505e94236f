"""What the Slurm cluster allows and when it would start a job: read before anything is submitted.

The partition's limits (`scontrol show partition -o`: MaxNodes, MaxTime, its nodes and the GPUs on them) bound the
candidate grid, so a configuration the partition cannot run is dropped with the limit named instead of waiting in
the queue for ever (Slurm keeps a job over MaxNodes or MaxTime PENDING with reason PartitionNodeLimit or
PartitionTimeLimit). The queue's view of a candidate is Slurm's own estimate of its start, `sbatch --test-only`,
which validates the job and reports when the backfill scheduler would start it, without submitting anything.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import subprocess
import time
from dataclasses import dataclass

from tula_hpc.cluster.slurm_options import as_arguments, resource_options, site_options
from tula_hpc.cluster.slurm_states import controller_answers
from tula_hpc.core.job import Job, SlurmSettings
from tula_hpc.core.records import Selection

UNLIMITED = ("UNLIMITED", "INFINITE", "NONE")
CONTROLLER_PATIENCE_S, CONTROLLER_POLL_S = 600, 5.0  # a command tried again while slurmctld does not answer


class ClusterError(RuntimeError):
    """Slurm could not be asked (a command failed or printed what it should not); the message quotes it."""


def parse_duration(text: str) -> float | None:
    """Seconds in a Slurm time ("minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
    "days-hours:minutes", "days-hours:minutes:seconds"); None for UNLIMITED or INFINITE."""
    text = text.strip()
    if text.upper() in UNLIMITED:
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def format_minutes(seconds: float) -> int:
    """Whole minutes for sbatch --time, rounded up, at least one."""
    return max(1, math.ceil(seconds / 60))


@dataclass(frozen=True)
class PartitionLimits:
    """A partition's limits on one job; None where the partition sets none."""

    partition: str
    nodes: int
    max_nodes: int | None = None
    max_time_s: float | None = None
    gpus_per_node: int | None = None

    def breaks(self, candidate: dict) -> list[str]:
        """The limits `candidate` (nodes, gpus_per_node) breaks, each named as Slurm names it."""
        broken = []
        nodes = candidate["nodes"]
        if self.max_nodes is not None and nodes > self.max_nodes:
            broken.append(f"{nodes} nodes > partition {self.partition}'s MaxNodes={self.max_nodes}")
        if nodes > self.nodes:
            broken.append(f"{nodes} nodes > the {self.nodes} nodes of partition {self.partition}")
        gpus = candidate.get("gpus_per_node") or 0
        if gpus and self.gpus_per_node is not None and gpus > self.gpus_per_node:
            broken.append(f"{gpus} GPUs per node > the {self.gpus_per_node} of partition {self.partition}'s nodes")
        return broken


def within_partition(grid: list[dict], limits: PartitionLimits) -> tuple[list[dict], list[dict]]:
    """(the candidates the partition can run, the others each with the limits it breaks)."""
    kept, excluded = [], []
    for candidate in grid:
        broken = limits.breaks(candidate)
        if broken:
            excluded.append({**candidate, "breaks": broken})
        else:
            kept.append(candidate)
    return kept, excluded


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def parse_partitions(text: str) -> dict[str, PartitionLimits]:
    """Every partition in `scontrol show partition -o` (one line each), by name; "default" names the Default=YES
    one as well."""
    out = {}
    for line in text.splitlines():
        fields = _fields(line)
        if "PartitionName" not in fields:
            continue
        tres = dict(item.split("=", 1) for item in fields.get("TRES", "").split(",") if "=" in item)
        nodes = int(fields.get("TotalNodes") or tres.get("node") or 0)
        gpus = int(tres["gres/gpu"]) if "gres/gpu" in tres else None
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        limits = PartitionLimits(
            partition=fields["PartitionName"],
            nodes=nodes,
            max_nodes=None if max_nodes.upper() in UNLIMITED else int(max_nodes),
            max_time_s=parse_duration(fields.get("MaxTime", "UNLIMITED")),
            gpus_per_node=None if gpus is None or not nodes else gpus // nodes,
        )
        out[limits.partition] = limits
        if fields.get("Default") == "YES":
            out["default"] = limits
    return out


def _slurm(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd`'s output. A command that fails while slurmctld does not answer (restarting, failing over) is tried
    again until it answers, for CONTROLLER_PATIENCE_S: the plan stage's scontrol once failed a run that way
    (bench/chaos.py, a controller restart). Any other failure is a ClusterError at once."""
    deadline = time.time() + CONTROLLER_PATIENCE_S
    while True:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ClusterError(f"`{' '.join(cmd)}` could not run: {err}") from None
        if done.returncode == 0:
            return done
        if controller_answers() or time.time() > deadline:
            raise ClusterError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
        time.sleep(CONTROLLER_POLL_S)


def partition_limits(partition: str | None) -> PartitionLimits:
    """The limits of `partition` (None: the cluster's default partition), from scontrol."""
    partitions = parse_partitions(_slurm(["scontrol", "show", "partition", "-o"]).stdout)
    name = partition or "default"
    if name not in partitions:
        known = ", ".join(sorted(p for p in partitions if p != "default")) or "none"
        raise ClusterError(f"Slurm has no partition '{name}'; partitions: {known}")
    return partitions[name]


START_LINE = re.compile(r"Job \d+ to start at (\S+) using")


def parse_test_only(text: str) -> dt.datetime:
    """The start `sbatch --test-only` reports ("sbatch: Job 12 to start at 2026-11-24T19:00:00 using 2 processors
    on nodes n[1-2] in partition debug"), in the controller's local time."""
    found = START_LINE.search(text)
    if found is None:
        raise ClusterError(f"sbatch --test-only gave no start time: {text.strip()!r}")
    return dt.datetime.fromisoformat(found.group(1))


def test_only_command(nodes: int, gpus_per_node: int, time_min: int, sbatch_args: list[str]) -> list[str]:
    """The sbatch that asks when a job of this shape would start (its GPUs among `sbatch_args`); nothing is
    submitted."""
    cmd = ["sbatch", "--test-only", f"--nodes={nodes}", "--ntasks-per-node", str(max(1, gpus_per_node))]
    return cmd + [f"--time={time_min}", *sbatch_args, "--wrap", "true"]


def start_wait_s(nodes: int, gpus_per_node: int, time_min: int, sbatch_args: list[str]) -> float:
    """Seconds until Slurm would start a job of `nodes` x `gpus_per_node` for `time_min` minutes (0 when now)."""
    done = _slurm(test_only_command(nodes, gpus_per_node, time_min, sbatch_args))
    start = parse_test_only(done.stderr + done.stdout)
    return max(0.0, (start - dt.datetime.now()).total_seconds())


STARTUP_S = 300  # a job's start before its first step: prolog, interpreter, data set, model, process group


def train_time_limit_s(job: Job, candidate: dict, run_s: float, max_time_s: float | None) -> float:
    """The wall time a train job of `candidate` asks for when it is to run `run_s` seconds (validation and checkpoints
    included: selection.predicted_run's job_time_s): the run plus twice its relative uncertainty, plus one epoch with
    its end (the checkpoint cadence: what a requeue repeats), all times 1 + resources.time_margin, plus STARTUP_S; at
    most the partition's MaxTime. A job that outlives it is requeued from its checkpoint."""
    epochs = candidate.get("run_epochs", job.train.epochs)  # a candidate predicted before runs had other lengths
    epoch_s = candidate["time_s"] / epochs + candidate.get("outside_epoch_s", 0.0)
    spread = 1 + 2 * candidate.get("rel_uncertainty", 0.0)
    limit = (run_s * spread + epoch_s) * (1 + job.resources.time_margin) + STARTUP_S
    return limit if max_time_s is None else min(limit, max_time_s)


def sbatch_args(slurm: SlurmSettings, cpus_per_task: int, mem_gb: float, gpus_per_node: int) -> list[str]:
    """The options a job's sbatch carries besides its nodes, tasks and time (its CPUs, GPUs and memory, and what
    resources.slurm says: slurm_options.py, as for the per-stage jobs), so that --test-only asks about the job that
    would be submitted, and the measuring allocation is the shape its steps ask for."""
    options = {"cpus-per-task": cpus_per_task, **resource_options(slurm, gpus_per_node, mem_gb)}
    return as_arguments({**options, **site_options(slurm)})


def train_minutes(job: Job, candidate: dict, run_s: float | None, max_time_s: float | None) -> int:
    """The minutes a train job of `candidate` asks for when it is to run `run_s` seconds: resources.time_min where
    the limit is fixed, on the local launcher (no queue to gain a place in; its limit only kills) or without a
    prediction; else `train_time_limit_s`."""
    resources = job.resources
    if resources.time_limit == "fixed" or job.launcher != "slurm" or run_s is None:
        return resources.time_min
    return format_minutes(train_time_limit_s(job, candidate, run_s, max_time_s))


def max_time_s(job: Job) -> float | None:
    """The MaxTime of the job's partition on Slurm (None: unlimited, or the local launcher)."""
    if job.launcher != "slurm":
        return None
    return partition_limits(job.resources.slurm.partition).max_time_s


def train_job_minutes(job: Job, selection: Selection) -> int:
    """The minutes the train job of `selection` (selection.json, its prediction) asks for: its epochs with what their
    ends do outside them (a selection made before job_time_s was predicted: the epochs alone)."""
    predicted = selection.predicted or {}
    return train_minutes(job, selection.chosen, predicted.get("job_time_s", predicted.get("time_s")), max_time_s(job))


def queue_waits(job: Job, candidates: list[dict], run_seconds: list[float]) -> list[float]:
    """Slurm's estimate of how long each candidate's train job (its shape, the wall time it would ask for to run
    `run_seconds`) would wait to start; one `sbatch --test-only` per distinct request."""
    resources = job.resources
    limit, asked = max_time_s(job), {}
    waits = []
    for candidate, run_s in zip(candidates, run_seconds):
        gpus = candidate.get("gpus_per_node") or 0
        shape = (candidate["nodes"], gpus, train_minutes(job, candidate, run_s, limit))
        if shape not in asked:
            asked[shape] = start_wait_s(
                *shape, sbatch_args(resources.slurm, resources.cpus_per_task, resources.mem_gb, gpus)
            )
        waits.append(asked[shape])
    return waits
