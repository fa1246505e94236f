"""profile_jobs.py: a profile job that runs out of memory is a clear stage error naming what to do; any other failure
is raised as it is."""

import os

import pytest
import torch

from tests.conftest import default_job
from tula_hpc.cluster import launch
from tula_hpc.core.errors import StageError
from tula_hpc.profiling import step_timing
from tula_hpc.profiling.profile_jobs import profile_one

CANDIDATE = {"nodes": 1, "batch": 64}


class _RankEnded(Exception):
    """os._exit, as end_job_step ends the rank, without ending pytest."""


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("CUDA out of memory.")],
)
def test_a_profile_that_runs_out_of_memory_is_a_clear_stage_error(tmp_path, monkeypatch, error):
    """The failing rank records it and ends the job step; the stage names the job, the configuration, the memory
    model's largest batch and what to do, however the backend ended the other ranks."""

    def measure_out_of_memory(*args, **kwargs):
        raise error

    def end_rank(code):
        raise _RankEnded(code)

    def run_one_rank(fn, kwargs, spec, folder, name):
        with pytest.raises(_RankEnded):
            fn(**kwargs)
        raise launch.JobFailed(f"{name}: a rank exited with code 3")

    monkeypatch.setattr(step_timing, "measure", measure_out_of_memory)
    monkeypatch.setattr(os, "_exit", end_rank)
    monkeypatch.setattr(launch, "run", run_one_rank)
    with pytest.raises(StageError) as failure:
        profile_one(default_job(), CANDIDATE, tmp_path / "N1_B64.json", tmp_path / "work", 48)
    message = str(failure.value)
    assert "job 'digits-cnn': the profile at nodes=1, global batch 64 (64 per device) ran out of memory" in message
    assert "allows up to 48 per device" in message and "out of memory" in message.split("Error: ")[1]
    assert all(advice in message for advice in ("probe_memory", "resources.memory_headroom", "search.batch.max"))
    assert not (tmp_path / "N1_B64.json").exists()


def test_a_profile_that_fails_otherwise_is_not_taken_for_running_out_of_memory(tmp_path, monkeypatch):
    def run_failing(fn, kwargs, spec, folder, name):
        raise launch.JobFailed(f"{name}: node lost")

    monkeypatch.setattr(launch, "run", run_failing)
    with pytest.raises(launch.JobFailed, match="node lost"):
        profile_one(default_job(), CANDIDATE, tmp_path / "N1_B64.json", tmp_path / "work", 48)
