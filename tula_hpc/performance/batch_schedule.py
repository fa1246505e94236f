"""train.batch_schedule: a global batch that follows the gradient noise scale as training goes (issue 42), or a fixed
ramp of it (issue 58).

The goodput objectives choose (N, B) once, from the noise scale the profiles measure near initialisation; the scale
grows as training goes (three- to four-fold in our Fashion-MNIST runs), so that choice is biased toward small
batches. Pollux (OSDI'21) re-chooses the batch as training goes. With `adaptive`, the train stage does it at fixed
places of the run (every train.batch_schedule_every steps at the starting batch, laid out in samples so that a resumed
run decides where the uninterrupted one did) and at every epoch's end: the goodput choice (prediction.to_progress and
choice.decide, the select stage's own) among the fitted model's predictions (perfmodel.json's candidates) at the node
shape the run holds, at the noise scale the run has measured so far. Only the batch moves, never the allocation; a
change mid-epoch goes on at the epoch's next unseen sample (training/trainer.py). A batch is one of the grid's:
per-device up to the memory stage's largest; where a relaunch after running out of memory caps the slice a device
computes at once, the rest of the per-device batch is gradient accumulation (training/trainer.py).

What each strategy does with a new batch is what it does at that batch from the start (strategies.build_strategy),
placed at the samples trained so far in the new batch's steps (Strategy.resume), so that warm-up and decay lie over
samples (tokens), the optimiser's state carried over (Adam's moments zeroed where
train.adam_moments_on_batch_change says reset):
- adascale: its scale s = B / lr_base_batch changes, so does its gain; the progress made so far stays (the
  pairing Pollux itself uses);
- lrs, lars (and ags or static on them): the peak rate follows B linearly (square root under Adam), warm-up and
  decay at the run's place;
- lbt (and ags or static on sgd): the rate stays; AGS keeps its factors within the new batch's range.
They train train.epochs (stretched to the selected batch's progress under a goodput objective); adascale trains
until the recipe's progress. polo is refused at validation (config.ADAPTIVE_BATCH_REFUSED), as is adaptive over one
rank.

`ramp` (BatchRamp) is the fixed warm-up of the batch a noise-scale schedule must beat (GPT-3's; Merrill et al. 2025):
it asks the same questions by the run's place alone. No torch here: the train stage sets the schedule up on the login
node.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tula_hpc.performance.choice import GOODPUT_GOALS, InfeasibleError, decide
from tula_hpc.performance.prediction import to_progress
from tula_hpc.training.progress import run_epochs, tokens_per_sample

if TYPE_CHECKING:
    from tula_hpc.core.job import Job, TrainSettings


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


# adaptive's decisions mid-epoch by default: at every 20th of the run
DECISIONS_EVERY = 1 / 20


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """What the adaptive schedule chooses among: the fitted model's candidates at the run's node shape, and the job
    whose recipe (train.epochs at train.lr_base_batch, not stretched) and objective the choice follows."""

    job: Job
    rows: tuple[dict, ...]
    train_samples: int
    every: float = DECISIONS_EVERY  # the share of the run between two decisions mid-epoch

    @classmethod
    def for_run(cls, job: Job, perfmodel: dict, chosen: dict, run: TrainSettings | None = None) -> BatchSchedule:
        """The candidates at the chosen node shape; decisions every train.batch_schedule_every steps at the chosen
        batch, as a share of the samples of the run the loop trains (`run`, default: the job's)."""
        shape = (chosen["nodes"], chosen.get("gpus_per_node") or 0)
        rows = tuple(r for r in perfmodel["candidates"] if (r["nodes"], r.get("gpus_per_node") or 0) == shape)
        if not rows:
            raise ValueError(f"perfmodel.json has no candidate at the selected nodes/GPUs per node {shape}")
        samples = int(perfmodel["train_samples"])
        steps = job.train.batch_schedule_every
        run_samples = run_epochs(run or job.train, samples, chosen["batch"], tokens_per_sample(job.data)) * samples
        every = DECISIONS_EVERY if steps is None else steps * chosen["batch"] / run_samples
        return cls(job, rows, samples, every)

    def start(self, selected_batch: int) -> int:
        """The selected batch: the schedule moves from there."""
        return selected_batch

    def due(self, before: float, after: float) -> bool:
        """Whether a step from run share `before` to `after` passes a decision (every `every` of the run)."""
        return int(after / self.every) > int(before / self.every)

    def choose(self, global_batch: int, noise: dict | None, progress: float = 0.0) -> dict:
        """The batch from here from the noise scale measured so far (`noise`: NoiseScaleHook.read's record):
        {global_batch, b_noise, reason}; the batch stays where nothing was measured or nothing is feasible. The run's
        place (`progress`) plays no part."""
        b_noise = (noise or {}).get("b_noise")
        if not b_noise or b_noise <= 0:
            return {"global_batch": global_batch, "b_noise": None, "reason": "no noise scale measured"}
        try:
            row = goodput_choice(self.job, list(self.rows), self.train_samples, b_noise)
        except InfeasibleError as err:
            return {"global_batch": global_batch, "b_noise": b_noise, "reason": f"kept: {err}"}
        return {"global_batch": int(row["batch"]), "b_noise": b_noise, "reason": "goodput"}


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    """train.batch_schedule ramp: the global batch doubles from `start_batch` while below `end_batch` (the selected
    batch; the last doubling capped at it), each batch below it for an equal share of the first `fraction` of the
    run's samples, `end_batch` from there on. 16 to 128 over 0.2: 16, 32 and 64 each for a third of 20 %."""

    start_batch: int
    end_batch: int
    fraction: float

    def __post_init__(self) -> None:
        if not 1 <= self.start_batch <= self.end_batch:
            raise ValueError(
                f"field 'train.ramp.start_batch': {self.start_batch} must lie between 1 and the selected batch "
                f"{self.end_batch}, where the ramp ends"
            )

    @classmethod
    def for_run(cls, job: Job, selected_batch: int, world_size: int) -> BatchRamp:
        """train.ramp from its start batch (train.lr_base_batch where unset) to the selected batch, each of its
        batches split evenly over `world_size` ranks (ValueError naming the field otherwise)."""
        ramp = job.train.ramp
        schedule = cls(ramp.start_batch or job.train.lr_base_batch, selected_batch, ramp.fraction)
        uneven = [batch for batch in schedule.batches() if batch % world_size]
        if uneven:
            raise ValueError(
                f"field 'train.ramp.start_batch': the ramp's batches {uneven} do not split evenly over {world_size} "
                f"ranks; allowed: a start batch whose doublings are multiples of {world_size}"
            )
        return schedule

    def batches(self) -> list[int]:
        """The ramp's batches in order, `end_batch` last."""
        batches = [self.start_batch]
        while batches[-1] < self.end_batch:
            batches.append(min(2 * batches[-1], self.end_batch))
        return batches

    def batch_at(self, progress: float) -> int:
        """The batch at run share `progress` (samples trained over the run's)."""
        batches = self.batches()
        if progress >= self.fraction:
            return self.end_batch
        return batches[int(progress * (len(batches) - 1) / self.fraction)]

    def start(self, selected_batch: int) -> int:
        """The ramp's first batch; the selected batch is where it ends."""
        return self.start_batch

    def due(self, before: float, after: float) -> bool:
        """Whether a step from run share `before` to `after` passes a change of the ramp's batch."""
        return self.batch_at(before) != self.batch_at(after)

    def choose(self, global_batch: int, noise: dict | None, progress: float = 0.0) -> dict:
        """The ramp's batch at `progress`, the noise scale recorded beside it (None where none is measured)."""
        return {"global_batch": self.batch_at(progress), "b_noise": (noise or {}).get("b_noise"), "reason": "ramp"}
