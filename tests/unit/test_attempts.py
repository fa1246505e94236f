"""attempts.py: after running out of memory the next attempt halves the slice (or the global batch) until one
sample per device fails, which stops training with a clear error."""

import pytest

from tests.conftest import default_job
from tula_hpc.core.errors import StageError
from tula_hpc.training.attempts import STOP_WARNING_MIN_S, StopTimes, after_out_of_memory, next_attempt, stop_warning_s


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


def test_the_warning_before_the_time_limit_fits_a_step_and_a_save_twice_over_with_bounds(tmp_path):
    """2 x save + 2 x step + 30 s, at least 60 s, at most half the limit; nothing measured keeps the default."""
    assert stop_warning_s(None, 30) is None
    assert stop_warning_s(StopTimes(save_s=40.0, step_s=2.5), 60) == 115
    assert stop_warning_s(StopTimes(save_s=40.2, step_s=2.5), 60) == 116  # 115.4, rounded up
    assert stop_warning_s(StopTimes(save_s=0.5, step_s=0.1), 60) == STOP_WARNING_MIN_S  # a tiny save: 60 s
    assert stop_warning_s(StopTimes(save_s=600.0, step_s=5.0), 30) == 15 * 60  # half of 30 minutes at most
    assert stop_warning_s(StopTimes(save_s=0.5, step_s=0.1), 1) == 30  # a 1-minute limit: half of it, not 60 s

    checkpoint = tmp_path / "train" / "checkpoint.pt"
    assert StopTimes.read(checkpoint) is None
    StopTimes(save_s=12.5, step_s=0.25).write(checkpoint)
    assert StopTimes.read(checkpoint) == StopTimes(save_s=12.5, step_s=0.25)
    assert StopTimes.path_for(checkpoint).parent == checkpoint.parent  # beside the checkpoint
