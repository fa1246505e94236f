"""Shared test helpers: the default job (raw config, validated settings, the shortened DAG job) and two-rank runs."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from tula_hpc.config import job_settings, validate_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def default_config() -> dict:
    """config/jobs.yaml as a user wrote it (no defaults filled in)."""
    return yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())


def tiny_job_config() -> dict:
    """The default digits job, shortened so that the whole DAG takes about a minute."""
    config = yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())
    job = config["jobs"]["digits-cnn"]
    job["train"].update(epochs=12, lr_milestones=[9])
    job["search"].update(warmup_steps=2, steps=4)
    return config


def default_job(**sections: dict) -> dict:
    """The default job's validated settings, as a stage sees them, each section updated by `sections`."""
    config = yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())
    job = job_settings(validate_config(config), "digits-cnn")
    for section, changes in sections.items():
        job[section].update(copy.deepcopy(changes))
    return job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _joined(rank: int, port: int, worker, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(worker, *args) -> None:
    """`worker(rank, *args)` in two fresh processes that form one gloo group (a module-level function)."""
    mp.spawn(_joined, args=(free_port(), worker, args), nprocs=2, join=True)
