"""Shared test helpers: the default job (as written, as a stage sees it, shortened for the DAG) and two-rank runs."""

from __future__ import annotations

import copy
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from tula_hpc.config import job_settings, validate_config

REPO = Path(__file__).resolve().parent.parent
JOB = "digits-cnn"  # the one job config/jobs.yaml defines


def _merge(base: dict, changes: dict) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def job_config(**sections: dict) -> dict:
    """config/jobs.yaml as a user wrote it (no defaults filled in), the job's `sections` changed key by key."""
    config = yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())
    _merge(config["jobs"][JOB], sections)
    return config


def default_job(**sections: dict) -> dict:
    """The job's settings as a stage sees them: `job_config(**sections)` validated, so a test's job is one a user
    could write."""
    return job_settings(validate_config(job_config(**sections)), JOB)


def tiny_job_config() -> dict:
    """The default job, shortened so that the whole DAG takes about a minute."""
    return job_config(train=dict(epochs=12, lr_milestones=[9]), search=dict(warmup_steps=2, steps=4))


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


def snakemake_command(workdir: Path, profile: str, configfile: Path, *extra: str) -> list[str]:
    """This checkout's Snakefile run in `workdir` under profiles/`profile` with the jobs file `configfile`."""
    return [
        *(sys.executable, "-m", "snakemake", *extra, "-s", str(REPO / "Snakefile"), "-d", str(workdir)),
        *("--profile", str(REPO / "profiles" / profile), "--configfile", str(configfile)),
    ]
