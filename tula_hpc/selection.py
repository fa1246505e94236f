"""Stage `select`: the feasible configuration that minimises time, cost, or sits at the knee of time vs batch.

A configuration is a node shape (N nodes of g GPUs each; 4 x 1 and 2 x 2 are different ones) and a global batch.

Constraints (all optional): at most `max_nodes` nodes, a global batch of at most `max_batch`, predicted
time T within `deadline_s` and cost C within `budget`. When no candidate meets them the stage fails with
the closest candidates and which constraint each breaks, by how much.

Two knees are reported. Kneedle (kneed, as in the paper) on the best time per global batch; it
normalises both axes, so for t(B) = a/B + c its answer depends only on the sampled range of B. The
model-based knee is the smallest B from which every further doubling saves less than `knee_min_saving`
of the time. `knee_method` says which one the knee objective follows.

With objective.queue estimate on Slurm each candidate carries `wait_s`, Slurm's estimate of when its train job
would start (cluster.queue_waits), and the time goals minimise the wait plus the training: a configuration that
starts later is passed over exactly when its wait outweighs what it saves.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kneed import KneeLocator

from .cluster import queue_waits
from .layout import node_shape
from .records import FitResult, Selection
from .stage import StageError, stage_main

if TYPE_CHECKING:
    from .job import Job, ObjectiveSettings

RUNNERS_UP = 5
# What selection.json keeps of each runner-up; gpus_per_node where the plan made it a choice.
RUNNER_UP_FIELDS = (
    "nodes",
    "gpus_per_node",
    "batch",
    "per_device_batch",
    "time_s",
    "cost",
    "rel_uncertainty",
    "progress_time_s",
    "progress_cost",
    "wait_s",
)
CLOSEST_SHOWN = 3
# constraint key -> (candidate field, unit shown in messages)
CONSTRAINTS = {
    "max_nodes": ("nodes", ""),
    "max_batch": ("batch", ""),
    "deadline_s": ("time_s", " s"),
    "budget": ("cost", ""),
}


class InfeasibleError(StageError):
    """No candidate meets the constraints; the message lists the closest ones and what each breaks."""


def best_time_per_batch(candidates: list[dict]) -> list[dict]:
    """The fastest candidate at each global batch, whatever its node shape: the curve both knees read."""
    best: dict[int, dict] = {}
    for c in candidates:
        if c["batch"] not in best or c["time_s"] < best[c["batch"]]["time_s"]:
            best[c["batch"]] = c
    return [best[b] for b in sorted(best)]


def kneedle_knee(curve: list[dict]) -> int | None:
    times = [c["time_s"] for c in curve]
    if len(curve) < 3 or max(times) == min(times):  # no curve, no knee
        return None
    knee = KneeLocator([c["batch"] for c in curve], times, curve="convex", direction="decreasing").knee
    return None if knee is None else int(knee)


def model_knee(curve: list[dict], min_saving: float) -> int:
    """Smallest batch from which every further doubling saves less than `min_saving` of the time."""
    for i, c in enumerate(curve):
        later = curve[i + 1 :]
        if all((prev["time_s"] - nxt["time_s"]) / prev["time_s"] < min_saving for prev, nxt in zip([c] + later, later)):
            return c["batch"]
    return curve[-1]["batch"]


def violations(candidate: dict, objective: ObjectiveSettings) -> dict[str, float]:
    """Each broken constraint with its relative excess (0.25 = 25 % over the limit)."""
    broken = {}
    for key, (field, _) in CONSTRAINTS.items():
        limit = getattr(objective, key)
        if limit is not None and candidate[field] > limit:
            broken[key] = candidate[field] / limit - 1 if limit > 0 else float("inf")
    return broken


def _describe(candidate: dict, objective: ObjectiveSettings) -> str:
    parts = []
    for key, excess in violations(candidate, objective).items():
        field, unit = CONSTRAINTS[key]
        parts.append(
            f"{field} {candidate[field]:.6g}{unit} > {key} {getattr(objective, key):.6g}{unit} (+{excess:.0%})"
        )
    return f"{node_shape(candidate, 'N={}')}, B={candidate['batch']}: " + "; ".join(parts)


# goal -> (the figure it minimises, the tie-breaker, whether the wait in the queue adds to it); the goodput goals
# count the steps a batch needs to make the recipe's progress at the measured noise scale (perfmodel.to_progress),
# the others the recipe's epochs. With objective.queue estimate the time goals minimise the time to result.
GOALS = {
    "time": ("time_s", "cost", True),
    "cost": ("cost", "time_s", False),
    "goodput": ("progress_time_s", "progress_cost", True),
    "goodput_cost": ("progress_cost", "progress_time_s", False),
}


def _rank(candidates: list[dict], curve: list[dict], goal: str, knee: int) -> list[dict]:
    if goal in GOALS:
        first, second, waits = GOALS[goal]
        if any(first not in c for c in candidates):
            raise StageError(
                f"field 'objective.minimize': {goal} needs the gradient noise scale, which multi-rank profiles "
                f"measure, and perfmodel.json holds none; allowed: profile a configuration of 2 ranks or more "
                f"(search.nodes, search.gpus_per_node), or minimize time, cost or knee"
            )
        return sorted(candidates, key=lambda c: (c[first] + (c.get("wait_s", 0.0) if waits else 0.0), c[second]))
    at_knee = [c for c in curve if c["batch"] == knee]
    rest = sorted(
        (c for c in candidates if c not in at_knee),
        key=lambda c: (abs(c["batch"].bit_length() - knee.bit_length()), c["time_s"]),
    )
    return at_knee + rest


def select(candidates: list[dict], pricing: str, objective: ObjectiveSettings) -> dict:
    """The choice among perfmodel.json's `candidates` (priced by `pricing`): selection.json's fields but the job's
    name and the prediction of the run."""
    if not candidates:
        raise StageError("perfmodel.json has no candidates to choose from")
    feasible = [c for c in candidates if not violations(c, objective)]
    if not feasible:
        closest = sorted(candidates, key=lambda c: (sum(violations(c, objective).values()), c["time_s"]))[
            :CLOSEST_SHOWN
        ]
        raise InfeasibleError(
            "no candidate meets the constraints; closest: " + " | ".join(_describe(c, objective) for c in closest)
        )
    curve = best_time_per_batch(feasible)
    knees = {"kneedle": kneedle_knee(curve), "model": model_knee(curve, objective.knee_min_saving)}
    # Kneedle finds no knee on a curve without one (e.g. still falling steeply): the model knee stands in.
    knee_used = objective.knee_method if knees[objective.knee_method] is not None else "model"
    knee = knees[knee_used]
    ranked = _rank(feasible, curve, objective.minimize, knee)
    return {
        "objective": objective.minimize,
        "pricing": pricing,
        "knee_method": objective.knee_method,
        "knee_min_saving": objective.knee_min_saving,
        "chosen": ranked[0],
        "knees": knees,
        "knee_used": knee_used,
        "runners_up": [{k: c[k] for k in RUNNER_UP_FIELDS if k in c} for c in ranked[1 : 1 + RUNNERS_UP]],
        "constraints": {key: getattr(objective, key) for key in CONSTRAINTS},
        "feasible": len(feasible),
        "candidates": len(candidates),
        "best_time_curve": [{k: c[k] for k in ("batch", "nodes", "gpus_per_node", "time_s") if k in c} for c in curve],
    }


def predicted_run(job: Job, chosen: dict) -> dict:
    """Time and cost of the training the train stage will run: to the recipe's progress under a goodput objective
    or with adascale (which trains until it) where the noise scale was measured, else the recipe's epochs. `time_s`
    is the epochs' own time (steps, loading, warm-up: what train_time_s measures), `job_time_s` adds what every
    epoch's end does outside it (the strategy's epoch end, validation, the checkpoint: run_overhead.py)."""
    to_progress = job.objective.minimize in ("goodput", "goodput_cost") or job.train.strategy == "adascale"
    if to_progress and "progress_time_s" in chosen:
        run = {"time_s": chosen["progress_time_s"], "cost": chosen["progress_cost"], "to": "progress"}
        epochs = math.ceil(chosen["progress_epochs"])
    else:
        run = {"time_s": chosen["time_s"], "cost": chosen["cost"], "to": "epochs"}
        epochs = job.train.epochs
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
        choice = select(with_queue_waits(job, perfmodel.candidates), perfmodel.pricing, job.objective)
    except InfeasibleError as err:
        fields = "/".join(f"objective.{key}" for key in CONSTRAINTS if getattr(job.objective, key) is not None)
        raise InfeasibleError(f"job '{job.name}': fields '{fields}': {err}") from None
    selection = Selection(job=job.name, **choice, predicted=predicted_run(job, choice["chosen"]))
    selection.write(out)
    return selection


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--perfmodel", required=True, type=Path)
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/selection.json")

    return stage_main("select", add_args, lambda job, args: run_select(job, args.perfmodel, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
