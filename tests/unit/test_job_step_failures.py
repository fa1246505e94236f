"""A rank that runs out of memory ends its job step and leaves the stage a record; the stage imports no torch."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import REPO
from tula_hpc.cluster import shared_files
from tula_hpc.cluster.job_step_failures import out_of_memory_ends_job_step, out_of_memory_record
from tula_hpc.core.atomic_files import write_json


class _RankEnded(Exception):
    """os._exit, as end_job_step ends the rank, without ending pytest."""


def _end_rank(code):
    raise _RankEnded(code)


def test_a_rank_out_of_memory_records_it_for_the_stage_and_any_other_error_is_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "_exit", _end_rank)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(_RankEnded), out_of_memory_ends_job_step(str(tmp_path)):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    record = out_of_memory_record(tmp_path)
    assert record["rank"] == 1 and record["outcome"] == "out_of_memory" and 0 <= record["noticed_after_s"] < 5
    assert "recorded_at" not in record and "Tried to allocate" in record["error"]

    with pytest.raises(ValueError), out_of_memory_ends_job_step(str(tmp_path / "other")):
        raise ValueError("not memory")
    with pytest.raises(torch.OutOfMemoryError), out_of_memory_ends_job_step(None):  # in-process: raised
        raise torch.OutOfMemoryError("out of memory")
    assert out_of_memory_record(tmp_path / "other") is None


def answer(failure_dir: str) -> int:
    """A worker that runs and answers (launched by name in a process of its own)."""
    return 42


@pytest.mark.spawns
def test_a_stage_runs_a_worker_and_reads_how_it_ended_without_importing_torch(tmp_path):
    """The stages that launch workers wait where Snakemake runs, often a login node; reading the workers' failure
    records imported torch there (1.7 s of every probe, profile and train stage's start here; issue 39)."""
    script = (
        "import sys; from pathlib import Path; from tula_hpc.cluster import launch; "
        "worker = launch.Worker('tests.unit.test_job_step_failures', 'answer'); "
        f"print(launch.run_or_out_of_memory(worker, {{}}, launch.LaunchSpec('local'), Path({str(tmp_path)!r}), 'a')); "
        "print('torch' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert ran.stdout.splitlines()[-2:] == ["(42, None)", "False"], ran.stdout + ran.stderr


def test_an_out_of_memory_record_that_shows_late_on_a_shared_file_system_is_waited_for(tmp_path, monkeypatch):
    """The rank wrote it on its node; NFS shows it here later (within resources.slurm.file_system_lag_s)."""
    monkeypatch.setattr(shared_files, "FILE_POLL_S", 0.01)
    folder = tmp_path / "failures" / "abc"
    note = {"outcome": "out_of_memory", "rank": 0, "recorded_at": time.time()}
    threading.Timer(0.2, write_json, [folder / "rank0.json", note]).start()
    assert out_of_memory_record(folder, within_s=10)["outcome"] == "out_of_memory"
