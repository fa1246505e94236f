"""What the train stage hands one training attempt on the compute nodes, pickled into its job: a frozen dataclass, so
the stage (where Snakemake runs, without torch) and the loop (trainer.py's `train_handed_off`) agree on each field by
name and type, not on a dict's keys. Imports no torch: the stage builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


class BatchChooser(Protocol):
    """What the loop asks of a batch schedule (performance/batch_schedule.py's BatchSchedule and BatchRamp): the batch
    the run starts at, given the selected one; whether a step from one place of the run to the next passes a
    decision; and the global batch from here, from the noise scale measured so far and the run's place, with why. A
    place is a share of the run's samples trained, the same on every rank and in a resumed run."""

    def start(self, selected_batch: int) -> int: ...

    def due(self, before: float, after: float) -> bool: ...

    def choose(self, global_batch: int, noise: dict | None, progress: float) -> dict: ...


@dataclass(frozen=True)
class TrainHandoff:
    """`train_worker`'s arguments but the failure folder, which the launcher adds (launch.run_or_out_of_memory).

    `selected_batch` names the run's checkpoint; `schedule` is train.batch_schedule adaptive's or ramp's (None under
    fixed); `micro_cap` caps the slices a schedule's batches are computed in, set after running out of memory;
    `stop_warning_s` is the warning before the time limit the attempt's job gets (None: none), which the loop holds
    against its checkpoint saves."""

    job: Job
    global_batch: int
    checkpoint_path: str
    model_path: str
    metrics_path: str
    loop_log_path: str
    accumulation: int
    selected_batch: int
    schedule: BatchChooser | None = None
    micro_cap: int | None = None
    stop_warning_s: int | None = None
