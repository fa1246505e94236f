"""Stage `select`: the feasible configuration that minimises time, cost, or sits at the knee of time vs batch
(performance/choice.py decides: constraints, knees, ties within the noise), and what its run is predicted to take.

With objective.queue estimate on Slurm each candidate carries `wait_s`, Slurm's estimate of when its train job
would start (cluster.queue_waits), and the time goals minimise the wait plus the training: a configuration that
starts later is passed over exactly when its wait outweighs what it saves.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.cluster.partition import queue_waits
from tula_hpc.core.records import FitResult, Selection, sequence_fields
from tula_hpc.core.run_layout import node_shape
from tula_hpc.performance.choice import CONSTRAINTS, GOODPUT_GOALS, InfeasibleError, select
from tula_hpc.stages.runner import stage_main
from tula_hpc.training.progress import whole_epochs

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def predicted_run(job: Job, chosen: dict) -> dict:
    """Time and cost of the training the train stage will run: to the recipe's progress under a goodput objective
    or with adascale (which trains until it) where the noise scale was measured, else the recipe's epochs. `time_s`
    is the epochs' own time (steps, loading, warm-up: what train_time_s measures), `job_time_s` adds what every
    epoch's end does outside it (the strategy's epoch end, validation, the checkpoint: performance/run_overhead.py)."""
    to_progress = job.objective.minimize in GOODPUT_GOALS or job.train.strategy == "adascale"
    if to_progress and "progress_time_s" in chosen:
        run = {"time_s": chosen["progress_time_s"], "cost": chosen["progress_cost"], "to": "progress"}
        epochs = math.ceil(chosen["progress_epochs"])
    else:
        run = {"time_s": chosen["time_s"], "cost": chosen["cost"], "to": "epochs"}
        epochs = whole_epochs(chosen.get("run_epochs", job.train.epochs))  # the last may be part-run
    outside = epochs * chosen.get("outside_epoch_s", 0.0)  # 0 in a record made before it was predicted
    run.update(epochs=epochs, outside_epochs_s=outside, job_time_s=run["time_s"] + outside)
    if "wait_s" in chosen:  # objective.queue estimate: the scheduler's estimate at selection time
        run.update(wait_s=chosen["wait_s"], result_time_s=chosen["wait_s"] + run["job_time_s"])
    return run


def with_queue_waits(job: Job, candidates: list[dict]) -> list[dict]:
    """perfmodel.json's candidates each with its `wait_s` (cluster.queue_waits, for the training it would run) where
    objective.queue is estimate on Slurm; as they are elsewhere (the local launcher has no queue)."""
    if job.objective.queue != "estimate" or job.launcher != "slurm":
        return candidates
    waits = queue_waits(job, candidates, [predicted_run(job, c)["job_time_s"] for c in candidates])
    return [{**c, "wait_s": wait} for c, wait in zip(candidates, waits)]


def run_select(job: Job, perfmodel_path: Path, out: Path) -> Selection:
    perfmodel = FitResult.read(perfmodel_path)
    try:
        choice = select(
            with_queue_waits(job, perfmodel.candidates), perfmodel.pricing, job.objective, job.train.lr_base_batch
        )
    except InfeasibleError as err:
        fields = "/".join(f"objective.{key}" for key in CONSTRAINTS if getattr(job.objective, key) is not None)
        raise InfeasibleError(f"job '{job.name}': fields '{fields}': {err}") from None
    selection = Selection(
        job=job.name, **choice, predicted=predicted_run(job, choice["chosen"]), **sequence_fields(job)
    )
    for left_out in selection.unpredicted or []:
        print(
            f"[select] left {node_shape(left_out, 'N={}')} B={left_out['batch']} out of the choice: its "
            f"{', '.join(left_out['figures'])} could not be predicted (NaN or infinite)",
            flush=True,
        )
    selection.write(out)
    return selection


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--perfmodel", required=True, type=Path)
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/selection.json")

    return stage_main("select", add_args, lambda job, args: run_select(job, args.perfmodel, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
