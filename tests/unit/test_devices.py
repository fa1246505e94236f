"""A GPU job's device facts: the process group that serves a rank's tensors, the driver's version as the host
states it."""

import pytest
import torch

from tula_hpc.cluster import devices
from tula_hpc.cluster.devices import backend_for


def test_a_gpu_rank_joins_a_group_that_serves_its_cpu_tensors_too():
    """NCCL serves CUDA tensors only; profiling's bookkeeping collectives hold CPU tensors, which go to gloo."""
    mapping = dict(pair.split(":") for pair in backend_for(torch.device("cuda", 0)).split(","))
    assert mapping == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_rank_joins_gloo():
    assert backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize(
    "text, version",
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n", "535.104.05"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build\n", "550.54.14"),
    ],
)
def test_the_drivers_version_is_read_from_its_proc_file(monkeypatch, tmp_path, text, version):
    (tmp_path / "version").write_text(text + "GCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(devices, "NVIDIA_DRIVER_VERSION", tmp_path / "version")
    assert devices.driver_version() == version


@pytest.mark.parametrize("per_task", ["1", "a100:1"])
def test_a_rank_slurm_bound_one_gpu_takes_the_one_it_sees_whatever_its_local_rank(monkeypatch, per_task):
    """--gpus-per-task=1 (resources.slurm.gpu_binding: task): each rank sees its own GPU alone, as device 0."""
    monkeypatch.setattr(devices, "usable_gpus", lambda: 1)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", per_task)
    assert [devices.rank_gpu(local_rank) for local_rank in range(4)] == [0, 0, 0, 0]


def test_ranks_that_share_a_nodes_gpus_take_their_local_ranks_and_never_one_another_holds(monkeypatch):
    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    monkeypatch.setattr(devices, "usable_gpus", lambda: 2)
    assert devices.rank_gpu(1) == 1
    monkeypatch.setattr(devices, "usable_gpus", lambda: 1)
    monkeypatch.setattr(devices, "cuda_setup", lambda: "host h")
    with pytest.raises(devices.DeviceError, match="local rank 1 has no GPU of its own"):
        devices.rank_gpu(1)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "2")  # two GPUs per task, of which it sees one: not its own
    with pytest.raises(devices.DeviceError, match="local rank 1 has no GPU of its own"):
        devices.rank_gpu(1)
