"""memory_summary.py: memory.json from probes and trials, and the budgets it refuses."""

import os
import re

import pytest
import torch
import yaml

from tests.conftest import default_job, job_config
from tests.unit.test_budget import CUDA
from tests.unit.test_memory_model import (
    ACTIVATION_BYTES_PER_SAMPLE,
    BATCH_BYTES_PER_SAMPLE,
    PARAMS,
    fits,
    out_of_memory,
    probe,
    probes_at,
    step_parts,
)
from tula_hpc.config import ConfigError, load_config
from tula_hpc.core.errors import StageError
from tula_hpc.core.job import Job
from tula_hpc.memory import model as memory_model
from tula_hpc.memory.device_budget import GB, budget_bytes, nccl_ring_buffer_bytes
from tula_hpc.memory.model import collective_buffer_bytes
from tula_hpc.profiling.memory_probes import peak_fields
from tula_hpc.profiling.memory_summary import summarise

# --- memory.json and bad budgets --------------------------------------------------------------------

# The update is the peak at b = 64, an ordinary step's backward pass from b = 82 on.
SUMMARY_PARTS = {**step_parts(2e6, 5e4), "update/update": (6e6, 1e3)}


def summarise_with(job: Job, probes: list[dict], trials: list[dict], train: int = 100_000, ring: int = 0) -> dict:
    """memory.json from these probes and trials, as a probe job under the job's budget returns them (on the CPU,
    or on GPUs whose NCCL rings reserve `ring` bytes)."""
    steps = {
        "probes": probes,
        "trials": trials,
        "collective_buffer_bytes": ring,
        "device_memory_bytes": budget_bytes(job, torch.device("cpu")),
        "dataset": {"train": train, "val": 100, "test": 100},
    }
    return summarise(job, steps)


def job_with(device_memory_gb: float, nodes: int = 2) -> Job:
    return default_job(
        resources={"device_memory_gb": device_memory_gb, "memory_headroom": 0.1},
        search={"nodes": {"min": 1, "max": nodes}},
    )


@pytest.mark.parametrize("nodes, buckets", [(1, 0), (2, PARAMS)])  # several devices: DDP's buckets, a gradient copy
def test_summary_sizes_the_batch_for_the_usable_budget_and_ddp_buckets(nodes, buckets):
    largest = int((0.9 * GB - buckets - 2e6) // 5e4)
    trials = [fits(largest, 0.9 * GB - buckets)]
    result = summarise_with(job_with(1.0, nodes), probes_at([64, 128, 256], SUMMARY_PARTS), trials)
    assert result["predicted_max_batch"] == result["max_batch_per_device"] == largest
    assert result["verified"] and result["limited_by"] == "memory"
    assert result["ddp_bucket_bytes"] == buckets
    assert result["fit"]["intercept_bytes"] == pytest.approx(2e6 + buckets)
    assert result["fit"]["slope_bytes_per_sample"] == pytest.approx(5e4)
    assert result["fit"]["peak_part"] == "ordinary/backward"
    assert result["fit"]["departure"] == pytest.approx(0, abs=1e-12)
    assert result["predicted_peak_bytes"] <= result["usable_bytes"] == 0.9 * GB


def test_the_allocated_figure_sizes_the_batch_and_both_figures_are_reported():
    """A caching allocator reserves 10 % more than it allocates, plus a 1 MB segment: the batch is sized on what the
    steps allocate (the reserved slack is measured at the limit by CUDA's trials, not extrapolated)."""
    allocated = SUMMARY_PARTS
    reserved = {part: (1.1 * a + 1e6, 1.1 * s) for part, (a, s) in allocated.items()}
    probes = []
    for batch in (64, 128, 256):
        probes.append(
            {
                **probe(batch, allocated),
                **peak_fields(
                    {"allocated": probe(batch, allocated)["peaks"], "reserved": probe(batch, reserved)["peaks"]}
                ),
            }
        )
    result = summarise_with(job_with(1.0, nodes=1), probes, [])
    assert result["decided_by"] == "allocated"
    assert result["predicted_max_batch"] == int((0.9 * GB - 2e6) // 5e4)
    assert result["fit"]["slope_bytes_per_sample"] == pytest.approx(5e4)
    assert result["fit_reserved"]["slope_bytes_per_sample"] == pytest.approx(1.1 * 5e4)
    assert result["limit"] is None  # the CPU's trials confirm; CUDA's bracket
    assert result["composition"]["per_sample_bytes"]["temporaries"] == pytest.approx(
        5e4 - BATCH_BYTES_PER_SAMPLE - ACTIVATION_BYTES_PER_SAMPLE
    )


def test_memory_the_card_holds_outside_the_allocator_is_taken_off_the_budget():
    """A 1 GB budget on a 1 GB card whose CUDA context holds 100 MB: the steps may fill 90 % of 900 MB."""
    probes = [{**probe(b, SUMMARY_PARTS), "card_bytes": GB, "outside_allocator_bytes": 1e8} for b in (64, 128, 256)]
    result = summarise_with(job_with(1.0, nodes=1), probes, [])
    assert result["usable_bytes"] == 0.9 * (GB - 1e8) and result["outside_allocator_bytes"] == 1e8
    assert result["predicted_max_batch"] == int((0.9 * (GB - 1e8) - 2e6) // 5e4)
    assert memory_model.room_for_steps(job_with(0.5, nodes=1), int(0.5 * GB), probes) == 0.45 * GB  # the budget is less


def test_nccls_ring_buffers_are_taken_off_the_budget_and_reported():
    """On GPUs of a multi-device job NCCL's ring holds 50 MB beside DDP's buckets; its one-rank communicator, 30 MB,
    was measured outside the allocator."""
    probes = [
        {**probe(b, SUMMARY_PARTS), "card_bytes": GB, "outside_allocator_bytes": 1e8, "collective_library_bytes": 3e7}
        for b in (64, 128, 256)
    ]
    result = summarise_with(job_with(1.0, nodes=2), probes, [], ring=50_000_000)
    assert result["collective_buffer_bytes"] == 50_000_000 and result["collective_library_bytes"] == 3e7
    assert result["predicted_max_batch"] == int((0.9 * (GB - 1e8) - PARAMS - 5e7 - 2e6) // 5e4)
    assert result["fit"]["intercept_bytes"] == pytest.approx(2e6 + PARAMS + 5e7)
    assert result["composition"]["fixed_bytes"]["nccl_ring_buffers"] == 50_000_000


def test_only_gpus_of_a_multi_device_job_reserve_nccls_ring():
    assert collective_buffer_bytes(job_with(1.0, nodes=2), CUDA) == nccl_ring_buffer_bytes(os.environ) > 0
    assert collective_buffer_bytes(job_with(1.0, nodes=1), CUDA) == 0
    assert collective_buffer_bytes(job_with(1.0, nodes=2), torch.device("cpu")) == 0


def test_without_a_trial_that_fit_the_largest_probe_under_the_usable_budget_stays_unverified():
    # 15.5 MB: 13.95 MB usable, 13.35 MB after the buckets; the probe at 256 peaks at 14.8 MB, at 128 at 8.4 MB
    trials = [out_of_memory(227, 1.4e7), out_of_memory(200, 1.4e7)]
    result = summarise_with(job_with(0.0155), probes_at([64, 128, 256], SUMMARY_PARTS), trials)
    assert result["predicted_max_batch"] == 227
    assert result["max_batch_per_device"] == 128 and not result["verified"]


def test_a_batch_capped_by_the_training_set_says_so():
    result = summarise_with(job_with(1.0), probes_at([64, 128, 256], SUMMARY_PARTS), [fits(1000, 5.2e7)], train=1000)
    assert result["max_batch_per_device"] == 1000 and result["limited_by"] == "training set"


def test_fewer_than_two_probes_that_ran_is_a_clear_error():
    probes = [out_of_memory(b, 2_000_000_000) for b in (64, 128, 256, 32, 16, 8)]
    with pytest.raises(
        StageError,
        match=r"job 'digits-cnn': field 'resources.device_memory_gb': 1.0 .* at batch 8: it needs more than "
        r"2,000,000,000 bytes; the memory model needs steps at two batches",
    ):
        summarise_with(job_with(1.0), probes, [])


def test_fewer_than_two_probes_that_ran_names_the_smallest_batch_that_failed():
    probes = [*(out_of_memory(b, 2_000_000_000) for b in (64, 128, 256, 32, 16)), probe(8, SUMMARY_PARTS)]
    with pytest.raises(StageError, match=r"at batch 16: it needs more than 2,000,000,000 bytes"):
        summarise_with(job_with(1.0), probes, [])


def test_budget_smaller_than_one_sample_names_the_job_and_the_bytes_needed():
    with pytest.raises(
        StageError,
        match=r"job 'digits-cnn': field 'resources.device_memory_gb': 0.002 .* "
        r"even at batch 1: it needs 6,601,000 bytes",  # the update at b = 1, 6,001,000, and the buckets
    ):
        summarise_with(job_with(0.002), probes_at([64, 128, 256], SUMMARY_PARTS), [])


def test_a_budget_that_cannot_hold_the_model_raises_the_probes_error():
    error = "job 'digits-cnn': field 'resources.device_memory_gb': a budget of 1,000 bytes cannot hold tiny_cnn at all"
    probes = [*probes_at([64, 128], SUMMARY_PARTS), {"batch": 256, "outcome": "budget_too_small", "error": error}]
    with pytest.raises(StageError, match=re.escape(error)):
        summarise_with(job_with(1.0), probes, [])


@pytest.mark.parametrize(
    "resources, message",
    [
        ({"device_memory_gb": 0}, r"'resources.device_memory_gb': 0 is less than or equal to the minimum of 0"),
        (
            {"memory_probe_batches": [16, 32, 64]},
            r"'resources.memory_probe_batches': 16 is below train.ags.small_batch",
        ),
        ({"memory_probe_batches": [64]}, r"'resources.memory_probe_batches': \[64\] is not valid; .* at least 2"),
    ],
)
def test_budgets_and_probes_that_cannot_work_are_refused_when_the_config_is_read(tmp_path, resources, message):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(job_config(resources=resources)))
    with pytest.raises(ConfigError, match=r"job 'digits-cnn': field " + message):
        load_config([tmp_path / "jobs.yaml"])
