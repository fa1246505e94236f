"""Stage `profile`: a few real DDP training steps at one planned (nodes, GPUs per node, global batch), timed part by
part on the candidate's nodes by profiling/step_timing.py's worker; this module runs where Snakemake runs and only
submits that job (profiling/profile_jobs.py). The profiles beyond the plan are the adapt stage's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.atomic_files import read_json
from tula_hpc.core.dependencies import fingerprint
from tula_hpc.core.errors import StageError
from tula_hpc.core.run_layout import profile_name
from tula_hpc.performance.search_modes import adds_profiles
from tula_hpc.profiling.profile_jobs import give_back_allocation, profile_one
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def profile(
    job: Job, plan_path: Path, nodes: int, batch: int, out: Path, work_dir: Path, gpus_per_node: int | None = None
) -> dict:
    """Profile one planned candidate; `gpus_per_node` None: the node's own (resources.gpus_per_node)."""
    plan = read_json(plan_path)
    gpus = job.resources.gpus_per_node if gpus_per_node is None else gpus_per_node
    candidate = {"nodes": nodes, "gpus_per_node": gpus, "batch": batch}
    if not any(profile_name(c, job) == profile_name(candidate, job) for c in plan["profile"]):
        raise StageError(
            f"job '{job.name}': (nodes={nodes}, gpus_per_node={gpus}, batch={batch}) is not in the plan {plan_path}"
        )
    result = profile_one(job, candidate, out, work_dir, plan["max_batch_per_device"])
    if not adds_profiles(job.search.mode, job.search.confirm) and _plan_profiled(job, plan, out.parent):
        give_back_allocation(work_dir, "profile")
    return result


def _plan_profiled(job: Job, plan: dict, folder: Path) -> bool:
    """Whether every profile the plan asks for is written under the job's current settings."""
    current = fingerprint(job, "profile")
    paths = [folder / f"{profile_name(c, job)}.json" for c in plan["profile"]]
    return all(path.exists() and read_json(path).get("fingerprint") == current for path in paths)


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, type=Path, help="plan.json from the plan stage")
        parser.add_argument("--nodes", required=True, type=int, help="nodes of the configuration to profile")
        parser.add_argument("--batch", required=True, type=int, help="global batch of the configuration to profile")
        parser.add_argument(
            "--gpus-per-node", type=int, help="GPUs per node of that configuration (default: resources.gpus_per_node)"
        )
        parser.add_argument(
            "--out",
            required=True,
            type=Path,
            help="results/{job}/profile/N{n}_B{b}.json (N{n}_G{g}_B{b}.json at other GPUs per node than "
            "resources.gpus_per_node)",
        )

    def run(job: Job, args: argparse.Namespace) -> dict:
        return profile(job, args.plan, args.nodes, args.batch, args.out, args.work_dir, args.gpus_per_node)

    return stage_main("profile", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
