"""attempts.py: after running out of memory the next attempt halves the slice (or the global batch) until one
sample per device fails, which stops training with a clear error."""

import pytest

from tests.conftest import default_job
from tula_hpc.core.errors import StageError
from tula_hpc.training.attempts import after_out_of_memory, next_attempt


def test_relaunch_halves_the_slice_and_keeps_the_global_batch_until_one_sample():
    assert after_out_of_memory("keep_global_batch", 512, 1, world_size=2) == (512, 2)
    assert after_out_of_memory("keep_global_batch", 512, 128, world_size=2) == (512, 256)
    assert after_out_of_memory("keep_global_batch", 512, 256, world_size=2) is None
    assert after_out_of_memory("keep_global_batch", 6, 2, world_size=2) == (6, 4)  # slices of 2 and 1
    assert after_out_of_memory("shrink_global_batch", 512, 1, world_size=2) == (256, 1)
    assert after_out_of_memory("shrink_global_batch", 2, 1, world_size=2) is None


def test_after_one_sample_per_device_fails_training_stops_with_a_clear_error():
    job = default_job(resources={"device_memory_gb": 0.001})
    failed = {
        "global_batch": 4,
        "per_device_batch": 2,
        "accumulation": 2,
        "micro_batch": 1,
        "outcome": "out_of_memory",
        "rank": 1,
        "error": "DefaultCPUAllocator: can't allocate memory",
    }
    assert next_attempt(job, {"batch": 4}, [{**failed, "accumulation": 1, "micro_batch": 2}], world_size=2) == (4, 2)
    with pytest.raises(
        StageError,
        match=r"job 'digits-cnn': training ran out of memory even with 1 sample per device "
        r"at once \(2 attempts\): field 'resources.device_memory_gb' \(resources.device_memory_gb: 0.001\)",
    ):
        next_attempt(job, {"batch": 4}, [{**failed, "accumulation": 1, "micro_batch": 2}, failed], world_size=2)
