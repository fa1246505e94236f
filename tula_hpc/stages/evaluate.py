"""Stage `evaluate`: the trained model's test metrics in the task's words (training/evaluation.py, on the job's devices
at the trained per-device batch and precision: precise BN and as trained), and measured vs predicted training time
(`COMPARED` says exactly what: the whole run's epochs, and the first epoch apart from the steady ones).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc._legacy_paths import moved_names
from tula_hpc.cluster import launch
from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.records import Selection, TrainSummary
from tula_hpc.performance.epochs import compare_epochs, epoch_times
from tula_hpc.performance.pricing import costs
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

COMPARED = (
    "the epochs' own time on both sides: metrics.jsonl's epoch_time_s (steps, loading, the warm-up, the loader's "
    "restarts; not validation, checkpoints or the strategy's epoch end, which run outside it) against the "
    "prediction of the same span (W + E x steps + (E - 1) x c_epoch), the first epoch apart from the steady ones"
)
# Launched by name: the stage, which waits for it where Snakemake runs (a login node), imports no torch.
EVALUATE_WORKER = launch.Worker("tula_hpc.training.evaluation", "evaluate_worker")
__getattr__ = moved_names(__name__)  # jobs pickled when the worker lived here


def measured_costs(job: Job, summary: TrainSummary, memory: dict) -> dict[str, float | None]:
    """The trained run's cost in the job's pricing, priced as the prediction was (pricing.costs): for the epochs
    that count (`train_time_s`, what was predicted) and with the work lost to kills or OOM (what was spent)."""
    objective, partition = job.objective, job.resources.slurm.partition
    run = (summary.nodes, summary.world_size, summary.per_device_batch, objective, memory, partition)
    return {
        "measured_cost": costs(summary.train_time_s, *run)[objective.pricing],
        "measured_cost_with_lost_work": costs(summary.train_time_with_lost_work_s, *run)[objective.pricing],
    }


def evaluate(
    job: Job, model_path: Path, summary_path: Path, selection_path: Path, memory_path: Path, out: Path, work_dir: Path
) -> dict:
    summary, selection = TrainSummary.read(summary_path), Selection.read(selection_path)
    chosen = selection.chosen
    memory = read_json(memory_path)
    spec = launch.LaunchSpec.for_job(job, nodes=1, one_device=True)
    scores = launch.run(
        EVALUATE_WORKER,
        dict(job=job, model_path=str(Path(model_path).resolve()), per_device_batch=summary.per_device_batch),
        spec,
        Path(work_dir) / "evaluate",
        name=f"{job.name}-evaluate",
    )
    # The prediction is the time of the epochs that count; lost work is reported beside it, not compared.
    measured, predicted = summary.train_time_s, selection.predicted["time_s"]
    epochs = [record["epoch_time_s"] for record in summary.epoch_history]
    result = {
        "job": job.name,
        **scores,
        "nodes": chosen["nodes"],
        "global_batch": chosen["batch"],
        "measured_train_time_s": measured,
        "measured_train_time_with_lost_work_s": summary.train_time_with_lost_work_s,
        "predicted_train_time_s": predicted,
        "time_rel_error": (predicted - measured) / measured,
        "compared": COMPARED,
        "measured_epoch_s": epochs,
        "predicted_epoch_s": epoch_times(chosen, len(epochs)),
        **compare_epochs(epochs, epoch_times(chosen, len(epochs))),
        "predicted_job_time_s": selection.predicted.get("job_time_s"),
        "pricing": job.objective.pricing,
        **measured_costs(job, summary, memory),
        "predicted_cost": selection.predicted["cost"],
        "wall_time_s": summary.wall_time_s,
    }
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", required=True, type=Path, help="train/model.pt")
        parser.add_argument("--summary", required=True, type=Path, help="train/summary.json")
        parser.add_argument("--selection", required=True, type=Path)
        parser.add_argument("--memory", required=True, type=Path, help="memory.json (memory-based pricing)")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/eval.json")

    return stage_main(
        "evaluate",
        add_args,
        lambda job, args: evaluate(job, args.model, args.summary, args.selection, args.memory, args.out, args.work_dir),
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
