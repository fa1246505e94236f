"""Functions the integration tests run as launched jobs (importable by module path in the job's processes)."""

from __future__ import annotations

import copy
import os

from tula_hpc.train import train_worker


def train_with_budget_per_rank(budgets_gb: list[float], job: dict, **kwargs) -> dict | None:
    """train_worker with a device budget per rank, so one rank runs out of memory while its peer is mid-step."""
    job = copy.deepcopy(job)
    job["resources"]["device_memory_gb"] = budgets_gb[int(os.environ["RANK"])]
    return train_worker(job, **kwargs)
