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
