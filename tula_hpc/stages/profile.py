"""Stage `profile`: a few real DDP training steps at one (nodes, GPUs per node, global batch), timed part by part.

Steps are the job's own training step, timed part by part on the candidate's nodes by profiling/step_timing.py; this
module runs on the login node and only submits that worker (named, so that it imports torch on the nodes, not here).

With `--adaptive` the stage runs the profiles beyond the plan instead (the adapt rule): adaptive search's, one
profile job after another chosen by the performance model, and those that confirm the choice (see `adapt`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.cluster import launch
from tula_hpc.cluster.allocation import release_allocation
from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.dependencies import fingerprint
from tula_hpc.core.errors import StageError
from tula_hpc.core.run_layout import candidate_devices, configuration, profile_name, ranks_per_host
from tula_hpc.performance.search_modes import adaptive_search, adds_profiles, confirm_choice
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

PROFILE_WORKER = launch.Worker("tula_hpc.profiling.step_timing", "profile_worker")


def _out_of_memory_error(
    job: Job, nodes: int, batch: int, world_size: int, record: dict, max_per_device: int
) -> StageError:
    """A profile that ran out of memory: the memory model (memory.json, via the plan) sized the batch wrong."""
    return StageError(
        f"job '{job.name}': the profile at nodes={nodes}, global batch {batch} ({batch // world_size} per device) "
        f"ran out of memory on rank {record['rank']}, though the memory model (memory.json) allows up to "
        f"{max_per_device} per device; rerun probe_memory (delete results/{job.name}/memory.json) if the "
        f"device, the model or the job's settings changed, raise resources.memory_headroom, or lower "
        f"search.batch.max. Error: {record['error']}"
    )


def profile_one(job: Job, candidate: dict, out: Path, work_dir: Path, max_per_device: int) -> dict:
    """Run one profile job at a plan candidate's (nodes, GPUs per node, batch) and write its file atomically;
    `max_per_device` is memory.json's largest batch per device, for the error when the profile runs out of memory."""
    nodes, batch = candidate["nodes"], candidate["batch"]
    spec = launch.LaunchSpec.for_job(
        job, nodes=nodes, gpus_per_node=candidate.get("gpus_per_node"), measuring_in=work_dir
    )
    started = time.perf_counter()
    name = profile_name(candidate, job)
    result, out_of_memory = launch.run_or_out_of_memory(
        PROFILE_WORKER,
        dict(job=job, global_batch=batch, checkpoint_dir=str(Path(work_dir) / "profile" / name)),
        spec,
        Path(work_dir) / "profile" / name,
        name=f"{job.name}-profile-{name.replace('_', '-')}",
    )
    if out_of_memory is not None:
        raise _out_of_memory_error(job, nodes, batch, spec.world_size, out_of_memory, max_per_device)
    result.update(
        nodes=nodes,
        gpus_per_node=spec.gpus_per_node,
        launcher=spec.launcher,
        ranks_per_host=ranks_per_host(spec.launcher, nodes, spec.tasks_per_node),
        job_wall_s=time.perf_counter() - started,
        fingerprint=fingerprint(job, "profile"),
    )
    write_json(out, result)
    return result


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
        _give_back(work_dir)
    return result


def _plan_profiled(job: Job, plan: dict, folder: Path) -> bool:
    """Whether every profile the plan asks for is written under the job's current settings."""
    current = fingerprint(job, "profile")
    paths = [folder / f"{profile_name(c, job)}.json" for c in plan["profile"]]
    return all(path.exists() and read_json(path).get("fingerprint") == current for path in paths)


def _give_back(work_dir: Path) -> None:
    """The last measurement is written: the measuring allocation goes back now, not when the next stage starts."""
    if release_allocation(Path(work_dir)):
        print("[profile] the last measurement is written: gave the measuring allocation back", flush=True)


def adapt(
    job: Job, plan_path: Path, memory_path: Path | None, profile_paths: list[Path], out: Path, work_dir: Path
) -> dict:
    """The profiles beyond the plan: adaptive search (one at a time until the model is sure enough), then those that
    confirm the choice (search.confirm_choice: the predicted best and the rivals that could still beat it).

    adaptive.json holds the profiles it added, adaptive search's history and why it stopped, and the confirmation's
    (`confirm`). Each added profile is also kept in work/{job}/adaptive/ as soon as it is measured, so a killed
    stage resumes where it stopped: a kept profile made under the same settings is read back instead of measured
    again. `memory_path`: memory.json, for memory-based pricing (only read where profiles confirm the choice).
    """
    plan = read_json(plan_path)
    # A record names the configuration it measured (one made before GPUs per node was recorded ran the node's own).
    planned = {profile_name({**p, "batch": p["global_batch"]}, job): p for p in map(read_json, profile_paths)}
    current = fingerprint(job, "profile")
    added: list[dict] = []

    def measure_candidate(candidate: dict) -> dict:
        name = profile_name(candidate, job)
        if name in planned:
            return planned[name]
        kept = Path(work_dir) / "adaptive" / f"{name}.json"
        record = read_json(kept) if kept.exists() else None
        if record is None or record.get("fingerprint") != current:
            record = profile_one(job, candidate, kept, work_dir, plan["max_batch_per_device"])
        added.append(record)
        return record

    # The fit (scikit-learn, SciPy: a second to import) only here: a profile job of the plan has nothing to fit.
    from tula_hpc.performance.fitting import candidate_row, model_params

    search, settings = job.search, model_params(job)
    manifest = {"job": job.name, "history": [], "discrepancy_per_octave": settings["discrepancy_per_octave"]}
    if search.mode == "adaptive":
        result = adaptive_search(
            plan["candidates"],
            plan["profile"],
            measure_candidate,
            lambda c: candidate_row(c, candidate_devices(c, job), job.launcher),
            settings,
            search.adaptive.tolerance,
            search.adaptive.max_profiles,
        )
        profiles = result["profiles"]
        manifest.update(
            history=result["history"],
            discrepancy_per_octave=result["discrepancy_per_octave"],
            stopped=result["stopped"],
        )
    else:
        profiles = [measure_candidate(c) for c in plan["profile"]]
        manifest["stopped"] = f"{search.mode} search adds no profiles of its own"
    confirming = search.confirm > 0
    manifest["confirm"] = (
        _confirm(job, plan, memory_path, profiles, measure_candidate, manifest) if confirming else None
    )
    manifest.update(added=added, profiled=len(planned) + len(added), candidates=len(plan["candidates"]))
    write_json(out, manifest)
    _give_back(work_dir)
    return manifest


def _confirm(job: Job, plan: dict, memory_path: Path | None, profiles: list[dict], measure, manifest: dict) -> dict:
    """search.confirm_choice for the job's objective and constraints, on the fit the stage's settings make."""
    if memory_path is None:
        raise StageError(f"job '{job.name}': confirming the choice (search.confirm) needs memory.json (--memory)")
    from tula_hpc.performance.choice import decide
    from tula_hpc.performance.fitting import model_params
    from tula_hpc.performance.prediction import fit_and_predict

    memory = read_json(memory_path)
    settings = {**model_params(job), "discrepancy_per_octave": manifest["discrepancy_per_octave"]}
    result = confirm_choice(
        profiles,
        measure,
        lambda found: fit_and_predict(job, found, plan["candidates"], plan["dataset"]["train"], memory, settings)[3],
        lambda rows: decide(rows, job.objective, job.train.lr_base_batch),
        job.search.confirm,
    )
    decision = result["decision"]
    return {
        "objective": decision["goal"],
        "limit": result["limit"],
        "band_sigmas": result["band_sigmas"],
        "profiles": result["confirmed"],
        "stopped": result["stopped"],
        "chosen": configuration(decision["chosen"]),
    }


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, type=Path, help="plan.json from the plan stage")
        parser.add_argument("--nodes", type=int, help="nodes of the one configuration to profile")
        parser.add_argument("--batch", type=int, help="global batch of the one configuration to profile")
        parser.add_argument(
            "--gpus-per-node", type=int, help="GPUs per node of that configuration (default: resources.gpus_per_node)"
        )
        parser.add_argument(
            "--adaptive",
            action="store_true",
            help="adaptive search instead of one configuration: --out is then adaptive.json",
        )
        parser.add_argument("--profiles", type=Path, nargs="+", help="with --adaptive: the plan's profiles")
        parser.add_argument(
            "--memory",
            type=Path,
            help="with --adaptive: memory.json (for pricing the choice its profiles confirm)",
        )
        parser.add_argument(
            "--out",
            required=True,
            type=Path,
            help="results/{job}/profile/N{n}_B{b}.json (N{n}_G{g}_B{b}.json at other GPUs per node than "
            "resources.gpus_per_node), or results/{job}/adaptive.json with --adaptive",
        )

    def run(job: Job, args: argparse.Namespace):
        if args.adaptive:
            return adapt(job, args.plan, args.memory, args.profiles or [], args.out, args.work_dir)
        if args.nodes is None or args.batch is None:
            raise StageError("profile needs --nodes and --batch (or --adaptive)")
        return profile(job, args.plan, args.nodes, args.batch, args.out, args.work_dir, args.gpus_per_node)

    return stage_main("profile", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
