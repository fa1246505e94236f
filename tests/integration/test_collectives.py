"""Every collective the package calls is handed tensors on a device its process group serves.

Profiling, training with every strategy the schema allows and evaluation run on two ranks under a spy
(collective_workers.py) that checks each tensor against the group's backend config. On a machine with
two or more GPUs the ranks are CUDA ranks ("cpu:gloo,cuda:nccl" groups); elsewhere CPU ranks on gloo
(two NCCL ranks cannot share one GPU).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import JOB, REPO, tiny_job_config
from tests.integration.collective_workers import CollectiveSpy, served_device_types, spied_on_two_ranks
from tula_hpc.config import HOST_GB_PER_GPU_RANK, job_settings, validate_config
from tula_hpc.core.job import Job
from tula_hpc.profiling.step_timing import profile_worker
from tula_hpc.training.evaluation import evaluate_worker
from tula_hpc.training.trainer import train_worker

JOB_SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "jobs.schema.yaml").read_text())["properties"]["jobs"]
STRATEGIES = JOB_SCHEMA["additionalProperties"]["properties"]["train"]["properties"]["strategy"]["enum"]
GPUS = 2 if torch.cuda.device_count() >= 2 else 0
DEVICE_TYPE = "cuda" if GPUS else "cpu"
DDP_BUCKETS = "DDP gradient bucket (allreduce_hook)"  # DDP's own hook, where no other is registered
# What profiling and training register on several ranks: the all-reduce that measures the noise scale too.
MEASURED_BUCKETS = "DDP gradient bucket (_measured_all_reduce)"


def _job(**train) -> Job:
    """The tiny job, two epochs and a short profile; polo goes local after one epoch, AGS updates every 2 steps."""
    config = tiny_job_config()
    job = config["jobs"][JOB]
    job["train"].update(epochs=2, lr_milestones=[], warmup_epochs=1, **train)
    job["train"]["polo"]["sync_epochs"] = 1
    job["train"]["ags"]["update_every_steps"] = 2
    job["search"].update(warmup_steps=1, steps=2, min_measure_s=0, max_attempts=1)
    job["resources"]["gpus_per_node"] = GPUS
    if GPUS:  # one host's GPUs, one rank each, with the host memory each GPU rank needs
        job["search"]["nodes"].update(min=1, max=1)
        job["resources"]["mem_gb"] = GPUS * HOST_GB_PER_GPU_RANK
    return job_settings(validate_config(config), JOB)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """One launch of two ranks runs every phase (one process start-up, not one per phase); each rank's reports."""
    tmp = tmp_path_factory.mktemp("collectives")
    phases = [("profile", profile_worker, dict(job=_job(), global_batch=64))]
    for strategy in STRATEGIES:
        paths = {f"{name}_path": str(tmp / f"{strategy}-{name}") for name in ("checkpoint", "model", "metrics")}
        phases.append((strategy, train_worker, dict(job=_job(strategy=strategy), global_batch=128, **paths)))
    phases.append(("evaluate", evaluate_worker, dict(job=_job(), model_path=str(tmp / "ags-model"))))
    return spied_on_two_ranks(phases, tmp)


def _assert_served(reports: list[dict], phase: str) -> None:
    violations = [f"rank {rank}: {v}" for rank, report in enumerate(reports) for v in report[phase]["violations"]]
    assert not violations, f"{phase}: collectives handed tensors on devices their groups do not serve:\n" + "\n".join(
        violations
    )


def _calls(reports: list[dict], phase: str) -> dict[str, list[str]]:
    """Collectives rank 0 called in `phase`, with the device types of their tensors."""
    return reports[0][phase]["calls"]


@pytest.mark.integration
@pytest.mark.slow
def test_profiling_hands_every_collective_a_device_its_group_serves(reports):
    _assert_served(reports, "profile")
    calls = _calls(reports, "profile")
    # the interference gather, the barrier before the timed all-reduce, the all-reduce, DDP's overlapped one
    assert {"all_gather_object", "barrier", "all_reduce", MEASURED_BUCKETS} <= calls.keys()
    assert calls[MEASURED_BUCKETS] == [DEVICE_TYPE] and DEVICE_TYPE in calls["all_reduce"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_with_each_strategy_hands_every_collective_a_device_its_group_serves(reports, strategy):
    _assert_served(reports, strategy)
    calls = _calls(reports, strategy)
    # DDP's start-up checks and broadcasts, its gradient buckets, validation's (and AGS's, polo's) all-reduces
    hook = "DDP gradient bucket (post_localSGD_hook)" if strategy == "polo" else MEASURED_BUCKETS
    assert {"_verify_params_across_processes", "_broadcast_coalesced", hook, "all_reduce"} <= calls.keys()
    assert calls[hook] == [DEVICE_TYPE] and DEVICE_TYPE in calls["all_reduce"]


@pytest.mark.integration
@pytest.mark.slow
def test_evaluation_hands_every_collective_a_device_its_group_serves(reports):
    _assert_served(reports, "evaluate")
    assert _calls(reports, "evaluate") == {"all_reduce": [DEVICE_TYPE]}


def test_backend_configs_name_the_device_types_they_serve():
    assert served_device_types("cpu:gloo, cuda:nccl") == served_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert served_device_types("cuda:gloo") == {"cuda"}
    assert served_device_types("gloo") >= {"cpu", "cuda"}
    assert served_device_types("nccl") == {"cuda"}


def test_the_spy_reports_a_tensor_on_a_device_the_group_does_not_serve(monkeypatch):
    """A group whose only backend serves CUDA, handed CPU tensors by all_reduce and by DDP's gradient buckets."""
    spy = CollectiveSpy()
    spy.install(monkeypatch.setattr)
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with contextlib.suppress(RuntimeError):  # whatever the backend does with it, the spy saw it first
            dist.all_reduce(torch.ones(2))
        with contextlib.suppress(RuntimeError):
            net = DistributedDataParallel(nn.Linear(2, 1), init_sync=False)
            net(torch.ones(3, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    with pytest.raises(AssertionError) as failure:
        _assert_served([{"spied": spy.report()}], "spied")
    assert "all_reduce was handed a tensor on cpu; its group's backends are 'cuda:gloo'" in str(failure.value)
    assert f"{DDP_BUCKETS} was handed a tensor on cpu; its group's backends are 'cuda:gloo'" in str(failure.value)
