"""Stage `fit_model`: the performance model (performance/estimator.py) fitted to the profiles, and T and cost of every
candidate (performance/prediction.py: Eq. 4a, the run's warm-up and epoch ends, the job's pricing) in perfmodel.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tula_hpc.cluster.allocation import release_allocation
from tula_hpc.core.atomic_files import read_json
from tula_hpc.core.errors import StageError
from tula_hpc.core.records import FitResult, sequence_fields
from tula_hpc.core.run_layout import node_shape
from tula_hpc.performance.fitting import model_params, profile_row
from tula_hpc.performance.loader_rate import fit_loader_rate
from tula_hpc.performance.prediction import fit_and_predict
from tula_hpc.performance.run_overhead import fit_overheads
from tula_hpc.performance.search_modes import search_price
from tula_hpc.stages.runner import stage_main
from tula_hpc.training.progress import measured_noise_scale

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def _throughput(profile: dict) -> dict:
    """A text job's profile rate in samples and tokens per second (records.sequence_fields); nothing for an image
    job's, so its perfmodel.json stays as it was."""
    if "tokens_per_s" not in profile:
        return {}
    return {"samples_per_s": profile["samples_per_s"], "tokens_per_s": profile["tokens_per_s"]}


def _profiled(profiles: list[dict], predicted) -> list[dict]:
    """Each profile's measured step beside the model's prediction of it."""
    return [
        {
            "nodes": p["nodes"],
            "gpus_per_node": p["gpus_per_node"],
            "batch": p["global_batch"],
            "per_device_batch": p["per_device_batch"],
            "measured_step_s": p["median"]["step_s"],
            "predicted_step_s": float(s),
            "step_iqr_over_median": p["iqr_over_median"]["step_s"],
            "interference": p.get("interference"),
            **_throughput(p),
        }
        for p, s in zip(profiles, predicted)
    ]


def _disturbed(profiles: list[dict], tolerance: float) -> list[str]:
    """A note for each profile other work still disturbed after re-measuring."""
    return [
        f"profile {node_shape(p, 'N={}')} B={p['global_batch']} stayed disturbed by other work after re-measuring "
        f"(interference {p['interference']:.0%} > {tolerance:.0%}): its times may be far off; profile it again "
        f"when the machine is quieter, or use adaptive search, which checks the model on fresh profiles"
        for p in profiles
        if p.get("interference", 0.0) > tolerance
    ]


def fit_model(
    job: Job,
    plan_path: Path,
    memory_path: Path,
    profile_paths: list[Path],
    adaptive_path: Path | None,
    out: Path,
    work_dir: Path | None = None,
) -> FitResult:
    """perfmodel.json from the plan's profiles and the profiles adaptive.json added (adaptive search's, and those
    that confirmed the choice), with what the search's profiles cost against the whole grid's. Every
    measurement is written by now: the measuring phase's shared allocation (if any) is given back first. The last
    planned profile (or adapt) has usually given it back already; releasing is idempotent, and this covers a profile
    rerun alone (its plan's last profile was written by an earlier run)."""
    if work_dir is not None and release_allocation(Path(work_dir)):
        print("[fit-model] gave the measuring allocation back", flush=True)
    plan, memory = read_json(plan_path), read_json(memory_path)
    profiles = [read_json(path) for path in profile_paths]
    manifest = read_json(adaptive_path) if adaptive_path is not None else None
    if manifest is not None:
        profiles += manifest["added"]
    if not profiles:
        raise StageError(f"job '{job.name}': no profiles to fit the performance model to")
    settings = model_params(job)
    if manifest is not None:
        settings["discrepancy_per_octave"] = manifest["discrepancy_per_octave"]
    overheads = fit_overheads(profiles)
    loader = fit_loader_rate(profiles)
    model, loo, weight, candidates = fit_and_predict(
        job, profiles, plan["candidates"], plan["dataset"]["train"], memory, settings, overheads, loader
    )
    measured = _profiled(profiles, model.predict([profile_row(p) for p in profiles]))
    disturbed = _disturbed(profiles, job.search.interference_tolerance)
    result = FitResult(
        job=job.name,
        collective=model.collective,
        params=model.coefficients(),
        identified=model.identified_,
        notes=model.notes_ + overheads.notes_ + loader.notes_ + disturbed,
        grad_bytes=model.grad_bytes,
        train_samples=plan["dataset"]["train"],
        epochs=job.train.epochs,
        pricing=job.objective.pricing,
        profiled=measured,
        search={
            "mode": plan["mode"],
            "history": manifest["history"] if manifest else [],
            "stopped": manifest["stopped"] if manifest else None,
            "confirm": manifest.get("confirm") if manifest else None,
            "price": search_price(profiles, candidates),
        },
        leave_one_out={
            "count": len(loo),
            "median_rel_error": float(np.median(loo)) if loo else None,
            "max_rel_error": max(loo) if loo else None,
        },
        measurement_weight=weight,
        noise_scale=measured_noise_scale(profiles),
        candidates=candidates,
        run_overheads=overheads.coefficients(),
        loader_rate=loader.coefficients(),
        **sequence_fields(job),
    )
    result.write(out)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, type=Path)
        parser.add_argument("--memory", required=True, type=Path, help="memory.json (memory-based pricing)")
        parser.add_argument("--profiles", required=True, type=Path, nargs="+", help="the plan's profile/N{n}_B{b}.json")
        parser.add_argument("--adaptive", type=Path, help="adaptive.json: the profiles added beyond the plan")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/perfmodel.json")

    return stage_main(
        "fit-model",
        add_args,
        lambda job, args: fit_model(job, args.plan, args.memory, args.profiles, args.adaptive, args.out, args.work_dir),
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
