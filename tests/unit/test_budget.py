"""The device memory budget: allocations beyond it fail for real, as PyTorch's own out-of-memory error."""

import pytest
import torch

from tests.conftest import default_job
from tula_hpc.budget import DeviceBudgetError, device_memory, is_out_of_memory


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
