"""The device memory budget: allocations beyond it fail for real, as PyTorch's own out-of-memory error."""

import pytest
import torch
import yaml

from tests.conftest import default_job, job_config
from tula_hpc.budget import (
    GB,
    DeviceBudgetError,
    budget_bytes,
    budget_source,
    device_memory,
    is_out_of_memory,
    usable_bytes,
)
from tula_hpc.config import ConfigError, load_config


def test_the_budget_makes_allocations_fail_for_real_and_is_lifted():
    job = default_job()
    device = torch.device("cpu")
    device_memory.limit(device, budget_bytes=2_000_000, resident_bytes=500_000, job=job)
    try:
        kept = torch.empty(1_000_000, dtype=torch.uint8)
        assert device_memory.in_use(device) == 1_500_000
        with pytest.raises(torch.OutOfMemoryError, match="can't allocate memory") as failure:
            torch.empty(600_000, dtype=torch.uint8)
        assert is_out_of_memory(failure.value) and device_memory.failed_at(device) == 2_100_000
        del kept
        torch.empty(1_400_000, dtype=torch.uint8)
        assert device_memory.peak(device) == 1_900_000
    finally:
        device_memory.lift()
    torch.empty(10_000_000, dtype=torch.uint8)
    with pytest.raises(DeviceBudgetError, match=r"job 'digits-cnn': .* the model alone needs 3,000,000 bytes"):
        device_memory.limit(device, budget_bytes=2_000_000, resident_bytes=3_000_000, job=job)


def test_auto_is_the_devices_own_memory_and_a_figure_is_taken_as_written():
    """On the CPU the device is the host memory the job asks of a node (resources.mem_gb), shared by its ranks."""
    cpu = torch.device("cpu")
    auto = default_job(resources={"device_memory_gb": "auto", "mem_gb": 8})
    assert budget_bytes(auto, cpu) == 8 * GB
    assert budget_source(auto) == "the device's own memory (resources.device_memory_gb: auto)"
    written = default_job(resources={"device_memory_gb": 0.5, "mem_gb": 8})
    assert budget_bytes(written, cpu) == 0.5 * GB and budget_source(written) == "resources.device_memory_gb: 0.5"
    assert usable_bytes(written, budget_bytes(written, cpu)) == 0.45 * GB  # the default 10 % headroom kept free


def test_device_memory_is_a_positive_figure_or_auto(tmp_path):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(job_config(resources={"device_memory_gb": "all"})))
    with pytest.raises(ConfigError, match=r"resources.device_memory_gb"):
        load_config([tmp_path / "jobs.yaml"])
