"""Functions the integration tests run as launched jobs (importable by module path in the job's processes)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import tula_hpc.training.step as training_module
import tula_hpc.training.trainer as train_module

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

NEVER_NOTICES_S = 600


def train_beside_a_rank_that_never_notices(budgets_gb: list[float], job: Job, **kwargs) -> dict | None:
    """train_worker with a device budget per rank; rank 0 stops before its first step as a rank stuck in a
    NCCL collective would (it never fails on its own), so only the job step's end can end it."""
    rank = int(os.environ["RANK"])
    job = job.updated(resources={"device_memory_gb": budgets_gb[rank]})
    if rank == 0:
        training_module.training_step = lambda *args, **kwargs: time.sleep(NEVER_NOTICES_S)
    return train_module.train_worker(job, **kwargs)
