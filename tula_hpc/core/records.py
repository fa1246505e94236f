"""The files one stage hands the next, as small typed records: perfmodel.json (fit-model), selection.json
(select) and train/summary.json (train). The writer builds the record and the reader gets it back field by field,
so a field renamed or dropped by one stage fails where the file is read, naming the file and the field. The rows
inside (candidates, profiles, history) stay dicts: the performance model's rows are built in one place
(performance/estimator.py) and carry what its variant knows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tula_hpc.core.atomic_files import StageInputError, read_json, write_json
from tula_hpc.core.plain_data import from_plain, optional, to_plain

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

R = TypeVar("R", bound="StageRecord")


class StageRecord:
    """A stage's output file: read(path) and write(path), the file's fields those of the dataclass."""

    @classmethod
    def from_dict(cls: type[R], data: dict) -> R:
        return from_plain(cls, data, cls.__name__)

    @classmethod
    def read(cls: type[R], path: str | os.PathLike) -> R:
        try:
            return cls.from_dict(read_json(path))
        except KeyError as err:
            raise StageInputError(f"{path}: {err.args[0]} (written by another version: rerun the stage)") from None

    def write(self, path: str | os.PathLike) -> None:
        write_json(path, self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return to_plain(self)


@dataclass(frozen=True)
class FitResult(StageRecord):
    """The fitted parallel performance model and its prediction for every candidate (fit-model's)."""

    job: str
    collective: str
    params: dict
    identified: dict
    notes: list[str]
    grad_bytes: float
    train_samples: int
    epochs: int
    pricing: str
    profiled: list[dict]
    search: dict
    leave_one_out: dict
    measurement_weight: float
    noise_scale: dict | None
    candidates: list[dict]
    run_overheads: dict | None = optional()  # run_overhead.RunOverheads.coefficients(); None: recorded before
    loader_rate: dict | None = optional()  # loader_rate.LoaderRate.coefficients(); None: recorded before
    seq_len: int | None = optional()  # data.seq_len (sequence_fields); None: an image job's, or recorded before


@dataclass(frozen=True)
class Selection(StageRecord):
    """The configuration chosen for training, why, and what it is predicted to take (select's)."""

    job: str
    objective: str
    pricing: str
    knee_method: str
    knee_min_saving: float
    chosen: dict
    knees: dict
    runners_up: list[dict]
    constraints: dict
    feasible: int
    candidates: int
    best_time_curve: list[dict]
    knee_used: str | None = optional()
    predicted: dict | None = optional()
    tie: dict | None = optional()  # choice.decide's tie record where configurations tied with the best
    unpredicted: list[dict] | None = optional()  # candidates left out of the choice: figures NaN or infinite
    seq_len: int | None = optional()  # data.seq_len (sequence_fields); None: an image job's, or recorded before

    @classmethod
    def by_hand(cls, job: Job, chosen: dict) -> Selection:
        """`chosen` (nodes, batch, per_device_batch) picked without the select stage and predicted nothing: how a
        test or a benchmark has the train stage run a configuration of its own."""
        objective = job.objective
        return cls(
            job=job.name,
            objective=objective.minimize,
            pricing=objective.pricing,
            knee_method=objective.knee_method,
            knee_min_saving=objective.knee_min_saving,
            chosen=chosen,
            knees={},
            runners_up=[],
            constraints={},
            feasible=1,
            candidates=1,
            best_time_curve=[chosen],
        )


@dataclass(frozen=True)
class TrainSummary(StageRecord):
    """What training did: its configuration, time, progress and every attempt (train's, from rank 0's summary)."""

    nodes: int
    global_batch: int
    per_device_batch: int
    world_size: int
    accumulation: int
    micro_batch: int
    epochs: int
    steps: int
    steps_per_epoch: int
    strategy: str
    train_samples: int
    train_time_s: float
    resumed_from_epoch: int | None
    resumed_from_step: int | None
    restarts_at_steps: list[int]
    history: list[dict]
    train_time_with_lost_work_s: float
    wall_time_s: float
    outside_allocator_bytes: int | None = optional()
    peak_reserved_bytes: int | None = optional()
    peak_allocated_bytes: int | None = optional()
    max_epochs: int | None = optional()
    gpus_per_node: int | None = optional()
    time_limit_min: int | None = optional()
    attempts: list[dict] | None = optional()
    batch_schedule: str | None = optional()
    optimizer_steps: int | None = optional()
    tokens: int | None = optional()

    @property
    def epoch_history(self) -> list[dict]:
        """The epochs' records, without those of a kind between them (validations by train.val_every_steps or
        val_every_tokens, the batch schedule's decisions mid-epoch)."""
        return [record for record in self.history if "kind" not in record]


def sequence_fields(job: Job, samples_per_s: float | None = None) -> dict:
    """What a record of a text job adds beside its batch: data.seq_len, and the tokens per second beside samples
    (`samples_per_s`, a profile's). Nothing where data.seq_len is unset, so an image job's records stay as they were."""
    seq_len = job.data.seq_len
    if seq_len is None:
        return {}
    return (
        {"seq_len": seq_len} if samples_per_s is None else {"seq_len": seq_len, "tokens_per_s": samples_per_s * seq_len}
    )
