"""A training run's attempts, decided where the train stage runs: the next one after running out of memory (a smaller
slice per device, or a smaller global batch), each one's record as it starts and as it ended (attempts.json and
train/summary.json's `attempts`, read by a restarted stage and by the report), and the warning its job gets before
the time limit, sized from the longest checkpoint save and step the loop measured (StopTimes, beside the checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.errors import StageError
from tula_hpc.memory.device_budget import budget_source

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def after_out_of_memory(on_oom: str, global_batch: int, accumulation: int, world_size: int) -> tuple[int, int] | None:
    """The next attempt's (global batch, accumulation) after running out of memory; None once one sample failed.

    keep_global_batch halves the slice each device computes at once and doubles the accumulation, so the
    selected configuration (global batch, steps, gradient statistics) stays; shrink_global_batch halves
    the global batch instead, as the paper does.
    """
    per_device = global_batch // world_size
    if math.ceil(per_device / accumulation) <= 1:
        return None
    if on_oom == "keep_global_batch":
        return global_batch, accumulation * 2
    return per_device // 2 * world_size, accumulation


def next_attempt(job: Job, chosen: dict, attempts: list[dict], world_size: int) -> tuple[int, int]:
    """(global batch, accumulation) of the next attempt; a failed attempt is rerun, an out-of-memory one shrunk (its
    slice only under train.batch_schedule adaptive or ramp, whose schedule owns the global batch)."""
    if not attempts:
        return chosen["batch"], 1
    last = attempts[-1]
    if last["outcome"] != "out_of_memory":
        attempts.pop()
        return last["global_batch"], last["accumulation"]
    on_oom = "keep_global_batch" if job.train.batch_schedule != "fixed" else job.resources.on_oom
    shrunk = after_out_of_memory(on_oom, last["global_batch"], last["accumulation"], world_size)
    if shrunk is None:
        raise StageError(
            f"job '{job.name}': training ran out of memory even with {last['micro_batch']} sample per device "
            f"at once ({len(attempts)} attempts): field 'resources.device_memory_gb' "
            f"({budget_source(job)}) "
            f"cannot train {job.model.name} with strategy {job.train.strategy}; last error: {last['error']}"
        )
    return shrunk


def attempt_at(global_batch: int, accumulation: int, world_size: int) -> dict:
    """An attempt's record as it starts."""
    per_device = global_batch // world_size
    return {
        "global_batch": global_batch,
        "per_device_batch": per_device,
        "accumulation": accumulation,
        "micro_batch": math.ceil(per_device / accumulation),
        "outcome": "running",
    }


def record_outcome(attempt: dict, result: dict, world_size: int) -> None:
    """How the attempt ended; out of memory, the rank, the error and the batch and slices it ran at when it failed
    (a batch schedule may have moved them since the attempt began)."""
    attempt.update(
        outcome=result.get("outcome", "completed"),
        **{k: result[k] for k in ("rank", "error", "noticed_after_s") if k in result},
    )
    if attempt["outcome"] == "out_of_memory" and "global_batch" in result:
        attempt.update(
            {k: result[k] for k in ("global_batch", "accumulation", "micro_batch")},
            per_device_batch=result["global_batch"] // world_size,
        )


STOP_WARNING_MIN_S = 60  # the least warning asked for, whatever the measurements: start-up noise in a short run


@dataclass(frozen=True)
class StopTimes:
    """What a stop before the time limit must fit, as this run measured it: its longest checkpoint save (rank 0's,
    the device's queued work left out) and longest step (an epoch's or part-epoch's mean, data loading in). The loop's
    rank 0 keeps it beside the checkpoint; the stage sizes the next job's warning from it (`stop_warning_s`)."""

    save_s: float = 0.0
    step_s: float = 0.0

    @staticmethod
    def path_for(checkpoint_path: str | Path) -> Path:
        return Path(checkpoint_path).with_name("stop_times.json")

    @classmethod
    def read(cls, checkpoint_path: str | Path) -> StopTimes | None:
        """The run's measurements; None before its first save."""
        path = cls.path_for(checkpoint_path)
        return cls(**read_json(path)) if path.exists() else None

    def write(self, checkpoint_path: str | Path) -> None:
        write_json(self.path_for(checkpoint_path), asdict(self))

    def needed_s(self) -> float:
        """The step in flight when the warning comes and the save after it, each twice over, and 30 s to spare
        (the requeue, the signal's delivery, a slower file system on the day)."""
        return 2 * self.save_s + 2 * self.step_s + 30


def stop_warning_s(times: StopTimes | None, time_min: int) -> int | None:
    """Seconds of warning before the time limit to ask for: what the measured stop needs, at least
    STOP_WARNING_MIN_S, at most half the limit (the job must have time to work); None with nothing measured yet,
    which keeps the launcher's default (LaunchSpec.warning_before_limit_s)."""
    if times is None:
        return None
    return min(max(STOP_WARNING_MIN_S, math.ceil(times.needed_s())), time_min * 60 // 2)
