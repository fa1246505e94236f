"""What the training loop keeps beside its steps: the loop's time in a log that outlives the process (what a kill or
running out of memory threw away counts as lost work), the steps rank 0 finished (for bench/chaos.py), and the time
the loop waited for its loader."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from tula_hpc.core.atomic_files import append_jsonl, read_jsonl

LOOP_LOG_EVERY_S = 10.0
STEP_TRACE_ENV = "TULA_STEP_TRACE"


class LoopClock:
    """Seconds this process spent in the epoch loop, appended to a log that survives the process.

    Each process is one session; the loop time of all sessions together, kept or lost, is what the
    run cost (`loop_time_s`).
    """

    def __init__(self, path: Path | None):
        self.path, self.session, self.spent, self.logged = path, uuid.uuid4().hex[:12], 0.0, 0.0

    def add(self, seconds: float, force: bool = False) -> None:
        self.spent += seconds
        if self.path is not None and (force or self.spent - self.logged >= LOOP_LOG_EVERY_S):
            append_jsonl(self.path, {"session": self.session, "loop_s": self.spent})
            self.logged = self.spent


class StepTrace:
    """Each step rank 0 finishes, appended as its number to the file TULA_STEP_TRACE names (none when unset): what
    bench/chaos.py counts to find steps computed twice, which no log kept every LOOP_LOG_EVERY_S can tell after a
    SIGKILL. One unbuffered line per step, so a kill loses none that finished."""

    def __init__(self, is_main: bool):
        path = os.environ.get(STEP_TRACE_ENV)
        self.file = open(path, "a", buffering=1) if path and is_main else None  # noqa: SIM115 (open for the run)

    def add(self, step: int) -> None:
        if self.file is not None:
            self.file.write(f"{step}\n")


def loop_time_s(path: Path) -> float:
    """Loop seconds of every session in the log (each session's last entry is its total)."""
    if not Path(path).exists():
        return 0.0
    return sum({r["session"]: r["loop_s"] for r in read_jsonl(path)}.values())


class TimedBatches:
    """A loader's batches, adding up the seconds the loop's host thread waited inside its `__next__` (`waited`).

    That is the loader's share of training's time: on a GPU its work overlaps the steps still queued on the
    device, which profiling's data part (every step waited for) cannot show.
    """

    def __init__(self, loader):
        self.loader, self.waited = loader, 0.0

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            self.waited += time.perf_counter() - asked
            if batch is None:
                return
            yield batch
