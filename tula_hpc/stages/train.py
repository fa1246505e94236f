"""Stage `train`: the selected configuration trained by training/trainer.py's loop on every rank, relaunched with
smaller slices while it runs out of memory; each attempt resumes from the last checkpoint. Under a goodput objective
the epochs are stretched to the chosen batch's progress; train.batch_schedule adaptive (the fitted model's candidates,
perfmodel.json) or ramp (start_batch doubled up to the selected batch) go to the loop, which changes the batch.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc._legacy_paths import moved_names
from tula_hpc.cluster import launch
from tula_hpc.cluster.partition import train_job_minutes
from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.errors import StageError
from tula_hpc.core.records import Selection, TrainSummary
from tula_hpc.performance.choice import GOODPUT_GOALS
from tula_hpc.stages.runner import stage_main
from tula_hpc.training.attempts import StopTimes, attempt_at, next_attempt, record_outcome, stop_warning_s
from tula_hpc.training.handoff import BatchChooser, TrainHandoff
from tula_hpc.training.loop_accounting import loop_time_s

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# Launched by name: the stage, which waits for it where Snakemake runs (a login node), imports no torch.
TRAIN_WORKER = launch.Worker("tula_hpc.training.trainer", "train_handed_off")
__getattr__ = moved_names(__name__)  # jobs pickled when the stage imported its worker


def stretched_to_progress(job: Job, chosen: dict) -> Job:
    """Under a goodput objective, the job with train.epochs (and its milestones with them) stretched to the epochs
    the chosen batch needs to make the recipe's progress (prediction.to_progress); adascale reaches that progress
    by its own gain, and the other objectives train the recipe's epochs."""
    if job.objective.minimize not in GOODPUT_GOALS or job.train.strategy == "adascale":
        return job
    epochs = max(1, math.ceil(chosen["progress_epochs"]))
    stretch = epochs / job.train.epochs
    milestones = [max(1, round(m * stretch)) for m in job.train.lr_milestones]
    return job.updated(train={"epochs": epochs, "lr_milestones": milestones})


def batch_schedule_for(job: Job, perfmodel_path: Path | None, chosen: dict, ranks: int = 1) -> BatchChooser | None:
    """train.batch_schedule's (adaptive's from perfmodel.json, ramp's over `ranks`); None under fixed."""
    if (kind := job.train.batch_schedule) == "fixed":
        return None
    if kind == "adaptive" and perfmodel_path is None:
        why = "adaptive chooses among the fitted model's candidates; give the train stage --perfmodel"
        raise StageError(f"job '{job.name}': field 'train.batch_schedule': {why} results/{job.name}/perfmodel.json")
    try:
        from tula_hpc.performance.batch_schedule import BatchRamp, BatchSchedule  # under a schedule only

        if kind == "ramp":
            return BatchRamp.for_run(job, chosen["batch"], ranks)
        run = stretched_to_progress(job, chosen).train  # the run the loop trains, whose shares place decisions
        return BatchSchedule.for_run(job, read_json(perfmodel_path), chosen, run)
    except ValueError as err:
        raise StageError(f"job '{job.name}' ({perfmodel_path or 'train.ramp'}): {err}") from err


def train(
    job: Job,
    selection_path: Path,
    summary_path: Path,
    model_path: Path,
    work_dir: Path,
    perfmodel_path: Path | None = None,
) -> TrainSummary:
    """Train the selected configuration, relaunched with smaller slices while it runs out of memory.

    Every attempt is recorded in work/{job}/train/attempts.json (so a restarted stage goes on from the last one) and
    in train/summary.json; each resumes from the last checkpoint, warned before its time limit as its saves need.
    `perfmodel_path`: the fitted model's candidates, which train.batch_schedule adaptive chooses among.
    """
    selection = Selection.read(selection_path)
    chosen = selection.chosen
    spec = launch.LaunchSpec.for_job(job, nodes=chosen["nodes"], gpus_per_node=chosen.get("gpus_per_node"))
    schedule = batch_schedule_for(job, perfmodel_path, chosen, spec.world_size)
    job, stage_dir = stretched_to_progress(job, chosen), Path(work_dir) / "train"
    spec = replace(spec, time_min=train_job_minutes(job, selection))
    started = time.time()
    selected = {key: chosen[key] for key in ("nodes", "gpus_per_node", "batch") if key in chosen}
    log_path = stage_dir / "attempts.json"
    log = read_json(log_path) if log_path.exists() else {}
    attempts = log["attempts"] if log.get("selected") == selected else []
    while True:
        global_batch, accumulation = next_attempt(job, chosen, attempts, spec.world_size)
        spec = replace(spec, stop_warning_s=stop_warning_s(StopTimes.read(stage_dir / "checkpoint.pt"), spec.time_min))
        attempts.append(attempt := attempt_at(global_batch, accumulation, spec.world_size))
        write_json(log_path, {"selected": selected, "attempts": attempts})
        result, out_of_memory = launch.run_or_out_of_memory(
            TRAIN_WORKER,
            dict(
                handoff=TrainHandoff(
                    job=job,
                    global_batch=global_batch,
                    checkpoint_path=str(stage_dir / "checkpoint.pt"),
                    model_path=str(Path(model_path).resolve()),
                    metrics_path=str(stage_dir / "metrics.jsonl"),
                    loop_log_path=str(stage_dir / "loop_time.jsonl"),
                    accumulation=accumulation,
                    selected_batch=chosen["batch"],
                    schedule=schedule,
                    # after running out of memory, the schedule's batches are computed in slices no larger
                    micro_cap=attempt["micro_batch"] if len(attempts) > 1 and schedule is not None else None,
                    stop_warning_s=spec.warning_before_limit_s,
                )
            ),
            spec,
            stage_dir,
            name=f"{job.name}-train",
        )
        result = result if out_of_memory is None else out_of_memory
        record_outcome(attempt, result, spec.world_size)
        write_json(log_path, {"selected": selected, "attempts": attempts})
        if attempt["outcome"] == "completed":
            break
        print(
            f"[train] out of memory on rank {attempt['rank']} at {attempt['micro_batch']} samples per device at once; "
            f"(recorded {attempt['noticed_after_s']} s before the job's end was known here)",
            flush=True,
        )
    summary = TrainSummary.from_dict(
        {
            **result,
            "nodes": chosen["nodes"],
            "gpus_per_node": spec.gpus_per_node,
            "time_limit_min": spec.time_min,
            "train_time_with_lost_work_s": loop_time_s(stage_dir / "loop_time.jsonl"),
            "wall_time_s": time.time() - started,
            "attempts": attempts,
        }
    )
    summary.write(summary_path)
    return summary


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--selection", required=True, type=Path, help="selection.json from the select stage")
        parser.add_argument("--summary", required=True, type=Path, help="results/{job}/train/summary.json")
        parser.add_argument("--model", required=True, type=Path, help="results/{job}/train/model.pt")
        parser.add_argument(
            "--perfmodel", type=Path, help="perfmodel.json: the candidates train.batch_schedule adaptive chooses among"
        )

    def run(job: Job, args: argparse.Namespace) -> dict:
        return train(job, args.selection, args.summary, args.model, args.work_dir, args.perfmodel)

    return stage_main("train", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
