"""Shared test helpers: the default job (as written, as a stage sees it, shortened for the DAG) and two-rank runs."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from tula_hpc.config import job_settings, load_config, validate_config
from tula_hpc.core.job import Job
from tula_hpc.core.plain_data import deep_update
from tula_hpc.core.records import Selection
from tula_hpc.memory.device_budget import cpu_allocator

pytest_plugins = ["tests.fast_tier", "pytester"]  # the fast tier's option, markers and guard; pytester tests the guard


def pytest_sessionstart(session) -> None:
    """In the fast tier, the CPU device budget's allocator is built (torch runs ninja, once a process) before any test:
    otherwise whichever test first trains under a budget would start that process and fail the guard."""
    if session.config.getoption("fast"):
        cpu_allocator()


REPO = Path(__file__).resolve().parent.parent
JOB = "digits-cnn"  # the one job config/jobs.yaml defines


def job_config(**sections: dict) -> dict:
    """config/jobs.yaml as a user wrote it (no defaults filled in), the job's `sections` changed key by key."""
    config = yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())
    deep_update(config["jobs"][JOB], sections)
    return config


def default_job(**sections: dict) -> Job:
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


# Two-rank runs fork from one server process that imported torch once for the session (a spawned rank imports it
# anew: seconds per rank); each rank is still a fresh process, forked before torch started a thread.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "tests.conftest"])


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone (its all-reduce leaves a tensor as it is), for code that talks to ranks."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_on_two_ranks(worker, *args) -> None:
    """`worker(rank, *args)` in two fresh processes that form one gloo group (a module-level function)."""
    mp.start_processes(_joined, args=(free_port(), worker, args), nprocs=2, join=True, start_method="forkserver")


def snakemake_command(workdir: Path, profile: str, configfile: Path, *extra: str) -> list[str]:
    """This checkout's Snakefile run in `workdir` under profiles/`profile` with the jobs file `configfile`."""
    return [
        *(sys.executable, "-m", "snakemake", *extra, "-s", str(REPO / "Snakefile"), "-d", str(workdir)),
        *("--profile", str(REPO / "profiles" / profile), "--configfile", str(configfile)),
    ]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def unique_job_config(tmp_path: Path, **train) -> tuple[str, Path]:
    """The tiny digits job under a fresh name (sacct keeps every earlier test run's jobs)."""
    config = tiny_job_config()
    name = f"t{uuid.uuid4().hex[:8]}"
    job = config["jobs"].pop("digits-cnn")
    job["train"].update(train)
    config["jobs"][name] = job
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(config))
    return name, path


def paced_job(tmp_path: Path, epochs: int, model: str = "tests.slurm.workers:paced_tiny_cnn", **resources):
    """The tiny digits job with epochs of about 20 steps x 0.2 s asleep (plus about 0.5 s of work here)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    name, config_path = unique_job_config(tmp_path, epochs=epochs, lr_milestones=[])
    config = yaml.safe_load(config_path.read_text())
    config["jobs"][name]["model"]["name"] = model
    config["jobs"][name]["resources"].update(resources)
    config_path.write_text(yaml.safe_dump(config))
    return name, config_path


def train_stage(
    tmp_path: Path,
    name: str,
    config_path: Path,
    launcher: str,
    tag: str,
    background: bool = False,
    nodes: int = 1,
    batch: int = 64,
):
    """The train stage's command line on the selection (nodes, batch), in tmp_path/tag; waited for unless
    `background` (then the Popen, output in its stdout)."""
    selection = tmp_path / f"selection-{tag}.json"
    job = job_settings(load_config([config_path]), name)
    Selection.by_hand(job, {"nodes": nodes, "batch": batch, "per_device_batch": batch // nodes}).write(selection)
    cmd = [
        *(sys.executable, "-m", "tula_hpc.stages.train", "--config", str(config_path), "--job", name),
        *("--launcher", launcher, "--selection", str(selection)),
        *("--summary", str(tmp_path / tag / "out" / "summary.json")),
        *("--model", str(tmp_path / tag / "out" / "model.pt")),
        *("--work-dir", str(tmp_path / tag / "work")),
    ]
    if background:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)


def fake_commands(tmp_path: Path, monkeypatch, **bodies: str) -> Path:
    """Shell scripts on PATH that log their arguments to calls.log and then run `body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name, body in bodies.items():
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >>{log}\n{body}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    return log
