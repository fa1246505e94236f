"""Stage `adapt`: the profiles beyond the plan, adaptive search's (one profile job after another, chosen by the
performance model until it is sure enough) and those that confirm the choice (search.confirm: the predicted best and
the rivals that could still beat it), each a profile job as the profile stage runs them (profiling/profile_jobs.py).

`tula-hpc profile --adaptive` still runs it (cli.py): the adapt rule calls it so, and Snakemake reruns a rule whose
command changed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.dependencies import fingerprint
from tula_hpc.core.errors import StageError
from tula_hpc.core.run_layout import candidate_devices, configuration, profile_name
from tula_hpc.performance.fitting import candidate_row, model_params
from tula_hpc.performance.search_modes import adaptive_search, confirm_choice
from tula_hpc.profiling.profile_jobs import give_back_allocation, profile_one
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


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
    give_back_allocation(work_dir, "adapt")
    return manifest


def _confirm(job: Job, plan: dict, memory_path: Path | None, profiles: list[dict], measure, manifest: dict) -> dict:
    """search.confirm_choice for the job's objective and constraints, on the fit the stage's settings make."""
    if memory_path is None:
        raise StageError(f"job '{job.name}': confirming the choice (search.confirm) needs memory.json (--memory)")
    from tula_hpc.performance.choice import decide  # kneed and SciPy's signal: where a choice is made
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
        parser.add_argument("--profiles", type=Path, nargs="+", help="the plan's profiles")
        parser.add_argument("--memory", type=Path, help="memory.json (for pricing the choice its profiles confirm)")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/adaptive.json")

    def run(job: Job, args: argparse.Namespace) -> dict:
        return adapt(job, args.plan, args.memory, args.profiles or [], args.out, args.work_dir)

    return stage_main("adapt", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
