"""train.batch_schedule: a global batch that follows the gradient noise scale as training goes (issue 42).

The goodput objectives choose (N, B) once, from the noise scale the profiles measure near initialisation; the scale
grows as training goes (three- to four-fold in our Fashion-MNIST runs), so that choice is biased toward small
batches. Pollux (OSDI'21) re-chooses the batch as training goes. With `adaptive`, the train stage does it at every
epoch's end: the goodput choice (prediction.to_progress and choice.decide, the select stage's own) among the
fitted model's predictions (perfmodel.json's candidates) at the node shape the run holds, at the noise scale the run
has measured so far. Only the batch moves, never the allocation, and never mid-epoch. A batch is one of the grid's:
per-device up to the memory stage's largest; where a relaunch after running out of memory caps the slice a device
computes at once, the rest of the per-device batch is gradient accumulation (training/trainer.py).

What each strategy does with a new batch is what it does at that batch from the start (strategies.build_strategy),
placed at the run's epoch (Strategy.resume), the optimiser's state carried over:
- adascale: its scale s = B / lr_base_batch changes, so does its gain; the progress made so far stays (the
  pairing Pollux itself uses);
- lrs, lars (and ags or static on them): the peak rate follows B linearly, warm-up and decay at the run's epoch;
- lbt (and ags or static on sgd): the rate stays; AGS keeps its factors within the new batch's range.
They train train.epochs (stretched to the selected batch's progress under a goodput objective); adascale trains
until the recipe's progress. polo is refused at validation (config.ADAPTIVE_BATCH_REFUSED), as is a search over one
rank. No torch here: the train stage sets the schedule up on the login node.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tula_hpc.performance.choice import GOODPUT_GOALS, InfeasibleError, decide
from tula_hpc.performance.prediction import to_progress

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def goodput_choice(job: Job, rows: list[dict], train_samples: int, b_noise: float) -> dict:
    """The goodput objective's choice among predicted candidates at noise scale `b_noise`, as the select stage makes
    it (goodput_cost where the job minimises cost to progress, goodput otherwise); raises InfeasibleError when no row
    meets the objective's constraints."""
    rows = [dict(r) for r in rows]
    to_progress(rows, job, train_samples, b_noise)
    objective = job.objective
    if objective.minimize not in GOODPUT_GOALS:
        objective = dataclasses.replace(objective, minimize="goodput")
    return decide(rows, objective, job.train.lr_base_batch)["chosen"]


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """What the adaptive schedule chooses among: the fitted model's candidates at the run's node shape, and the job
    whose recipe (train.epochs at train.lr_base_batch, not stretched) and objective the choice follows."""

    job: Job
    rows: tuple[dict, ...]
    train_samples: int

    @classmethod
    def for_run(cls, job: Job, perfmodel: dict, chosen: dict) -> BatchSchedule:
        shape = (chosen["nodes"], chosen.get("gpus_per_node") or 0)
        rows = tuple(r for r in perfmodel["candidates"] if (r["nodes"], r.get("gpus_per_node") or 0) == shape)
        if not rows:
            raise ValueError(f"perfmodel.json has no candidate at the selected nodes/GPUs per node {shape}")
        return cls(job, rows, int(perfmodel["train_samples"]))

    def choose(self, global_batch: int, noise: dict | None) -> dict:
        """The next epoch's batch from the noise scale measured so far (`noise`: NoiseScaleHook.read's record):
        {global_batch, b_noise, reason}; the batch stays where nothing was measured or nothing is feasible."""
        b_noise = (noise or {}).get("b_noise")
        if not b_noise or b_noise <= 0:
            return {"global_batch": global_batch, "b_noise": None, "reason": "no noise scale measured"}
        try:
            row = goodput_choice(self.job, list(self.rows), self.train_samples, b_noise)
        except InfeasibleError as err:
            return {"global_batch": global_batch, "b_noise": b_noise, "reason": f"kept: {err}"}
        return {"global_batch": int(row["batch"]), "b_noise": b_noise, "reason": "goodput"}
