"""Stage `plan`: the candidate grid of (nodes N, global batch B) and which candidates to profile first.

Candidates: N a power of two times the minimum, up to the maximum; B a power of two times the minimum
batch, up to the maximum (or N x the largest per-device batch from memory.json when `auto`), never above
the training set; B must split evenly over the N x devices ranks and fit in a device.

Search modes (paper III-A-2):
- full: every candidate.
- partial: the fewest extreme configurations that identify every coefficient of the performance model
  (see `partial_set`): 3 to 5 of them, whatever the size of the grid.
- adaptive: starts from partial; the profile stage's `--adaptive` mode then adds the candidate the
  fitted model is least sure about until its uncertainty, calibrated on those very profiles, is small.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .files import read_json, write_json
from .stage import StageError, stage_main


def ranks_per_host(launcher: str, nodes: int, devices_per_node: int) -> int:
    """Ranks that share one machine: the local launcher runs every "node" on this one."""
    return nodes * devices_per_node if launcher == "local" else devices_per_node


def _doublings(low: int, high: int) -> list[int]:
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return values


def candidate_grid(search: dict, devices_per_node: int, max_batch_per_device: int, train_samples: int) -> list[dict]:
    grid = []
    for nodes in _doublings(search["nodes"]["min"], search["nodes"]["max"]):
        ranks = nodes * devices_per_node
        memory_cap = ranks * max_batch_per_device
        batch_max = memory_cap if search["batch"]["max"] == "auto" else min(search["batch"]["max"], memory_cap)
        for batch in _doublings(search["batch"]["min"], min(batch_max, train_samples)):
            if batch % ranks == 0:
                grid.append({"nodes": nodes, "batch": batch, "per_device_batch": batch // ranks})
    return grid


def partial_set(grid: list[dict], devices_per_node: int, launcher: str) -> list[dict]:
    """The fewest extreme candidates that identify every coefficient the grid can identify.

    Both batch extremes at the smallest N fit the compute line; the smallest batch at the largest N adds
    sync and its overlap. When ranks share hosts differently across N (the local launcher), contention is
    fitted too, from a second batch at the largest N: the one nearest the geometric middle of its range
    (ties to the smaller). It identifies the per-sample contention as the largest batch would, at about
    1/8 of the largest's cost on a doubling grid, and measured here it predicts the rest at least as well
    (bench/perf_accuracy.py). A second multi-rank size, at its smallest batch, separates latency from bandwidth.
    """
    by_nodes: dict[int, list[dict]] = {}
    for c in sorted(grid, key=lambda c: (c["nodes"], c["batch"])):
        by_nodes.setdefault(c["nodes"], []).append(c)
    smallest, largest = min(by_nodes), max(by_nodes)
    chosen = [by_nodes[smallest][0], by_nodes[smallest][-1], by_nodes[largest][0]]
    if ranks_per_host(launcher, smallest, devices_per_node) != ranks_per_host(launcher, largest, devices_per_node):
        first, *rest = by_nodes[largest]
        if rest:
            middle = (math.log2(first["per_device_batch"]) + math.log2(rest[-1]["per_device_batch"])) / 2
            chosen.append(min(rest, key=lambda c: abs(math.log2(c["per_device_batch"]) - middle)))
    multi_rank = [n for n in by_nodes if n * devices_per_node > 1]
    if len({n for n in (smallest, largest) if n in multi_rank}) < 2 and len(multi_rank) >= 2:
        second = min(n for n in multi_rank if n not in (smallest, largest))
        chosen.append(by_nodes[second][0])
    return [c for i, c in enumerate(chosen) if c not in chosen[:i]]


def plan(job: dict, memory_path: Path, out: Path) -> dict:
    memory = read_json(memory_path)
    devices = max(1, job["resources"]["gpus_per_node"])
    grid = candidate_grid(job["search"], devices, memory["max_batch_per_device"], memory["dataset"]["train"])
    if not grid:
        raise StageError(
            f"job '{job['name']}': fields 'search.nodes'/'search.batch': no (nodes, batch) candidate fits: "
            f"batches must be multiples of nodes x devices, at most {memory['max_batch_per_device']} per device "
            f"(memory.json) and at most "
            f"{memory['dataset']['train']} (the training set)"
        )
    mode = job["search"]["mode"]
    result = {
        "job": job["name"],
        "mode": mode,
        "candidates": grid,
        "profile": grid if mode == "full" else partial_set(grid, devices, job["launcher"]),
        "max_batch_per_device": memory["max_batch_per_device"],
        "dataset": memory["dataset"],
    }
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--memory", required=True, type=Path, help="memory.json from probe_memory")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/plan.json")

    return stage_main("plan", add_args, lambda job, args: plan(job, args.memory, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
