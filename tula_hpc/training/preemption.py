"""Stopping training between two steps when the job is asked to go, so that no step's work is lost.

Two signals ask: submitit's requeue signal (USR2, `--signal=USR2@...` before the time limit or at
preemption; not USR1, which NCCL handles itself), and SIGTERM, which `scontrol requeue`, `scancel` and
Slurm's own preemption send KillWait seconds before SIGKILL. A handler only notes the signal. At every
step boundary the ranks agree on whether any of them was asked (a one-number all-reduce, started before
the step and read after it, so its latency hides behind the step), which keeps them in step: they all
save and leave after the same step. Then the signal's own consequence follows: submitit's handler
requeues the job (rank 0) for USR2; for SIGTERM Slurm is already ending the job, and the ranks exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from submitit import JobEnvironment

# submitit's requeue signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise), as its sbatch scripts ask Slurm.
REQUEUE_SIGNAL = getattr(signal, "SIG" + JobEnvironment.USR_SIG)
# After handing over to submitit, ranks other than 0 wait for the requeue (or the local launcher) to end
# them; should neither happen, they leave with an error rather than train on without rank 0.
ENDED_BY_OTHERS_WAIT_S = 600.0


class Preempted(RuntimeError):
    """Training stopped at a step boundary on a signal nobody else acts on (no submitit job around it)."""


class StopRequests:
    """Notes stop signals and turns them into one decision, taken by every rank after the same step.

    Use as a context manager around the training loop: `begin_step()` before a step, `agreed()` after
    it, and `leave()` once the checkpoint is saved.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.signals = (REQUEUE_SIGNAL, signal.SIGTERM)
        self.previous: dict[int, Any] = {}
        self.noted: int | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)  # a CPU tensor: every group we build serves the CPU
        self._pending = None

    def __enter__(self) -> StopRequests:
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame: object) -> None:
        self.noted = signum

    def begin_step(self) -> None:
        """Start agreeing on what has been noted so far; the answer is read after the step."""
        self._flag.fill_(0 if self.noted is None else 1)
        if self.world_size > 1:
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def agreed(self) -> bool:
        """Whether any rank had been asked to stop when this step began."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return bool(self._flag.item())

    def leave(self, rank: int) -> None:
        """End this process the way the signal asks, once every rank is past the checkpoint."""
        if self.world_size > 1:
            dist.all_reduce(torch.zeros(1, dtype=torch.int32))  # rank 0 has saved: nobody is killed mid-write
        signum = self.noted if self.noted is not None else self.signals[0]
        sys.stdout.flush()
        sys.stderr.flush()
        if signum == signal.SIGTERM:
            os._exit(128 + signal.SIGTERM)  # no result file: submitit must not take this run for finished
        handler: Callable | Any = self.previous.get(signum)
        if not callable(handler):
            raise Preempted(f"stopped on {signal.Signals(signum).name} at a step boundary; the checkpoint holds it")
        handler(signum, None)  # submitit: rank 0 requeues the job and exits; the other ranks return here
        time.sleep(ENDED_BY_OTHERS_WAIT_S)
        raise Preempted(f"rank {rank}: the job was not ended {ENDED_BY_OTHERS_WAIT_S:.0f} s after rank 0 requeued it")
