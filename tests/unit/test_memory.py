"""Stage probe_memory: one line per part of the steady steps and their envelope, the probes and trials that settle
the largest per-device batch, memory.json; synthetic probes with known lines, then one real probe and trial."""

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import yaml
from sklearn.linear_model import LinearRegression

from tests.conftest import default_job, job_config
from tests.unit.test_budget import CUDA, GiB, MiB, cuda_out_of_memory_message
from tula_hpc import memory
from tula_hpc.budget import GB, budget_bytes, nccl_ring_buffer_bytes
from tula_hpc.config import ConfigError, load_config
from tula_hpc.devices import DeviceError
from tula_hpc.memory import (
    GROWING_SHARE,
    MAX_PROBES,
    MAX_VERIFICATION_TRIALS,
    PARTS,
    StepMemoryModel,
    collective_buffer_bytes,
    composition,
    fit_probes,
    measured,
    next_probe,
    next_trial,
    peak_fields,
    run_in_fresh_process,
    run_probes,
    settle,
    summarise,
)
from tula_hpc.stage import StageError

# --- synthetic probes and trials --------------------------------------------------------------------

PARAMS = 600_000  # parameters, their gradients and the optimiser's momentum: this many bytes each
WORKSPACE = 100_000  # what else the steps keep on the device (cuBLAS's workspace)
BATCH_BYTES_PER_SAMPLE = 8
ACTIVATION_BYTES_PER_SAMPLE = 50


def step_parts(intercept: float, slope: float) -> dict[str, tuple[float, float]]:
    """(intercept, slope) of every part: an ordinary step's backward pass is the peak, the others half of it."""
    return {part: (intercept, slope) if part == "ordinary/backward" else (intercept / 2, slope / 2) for part in PARTS}


def probe(batch: int, parts: dict[str, tuple[float, float]]) -> dict:
    """A measured probe whose part peaks lie on `parts`' lines."""
    peaks = {part: intercept + slope * batch for part, (intercept, slope) in parts.items()}
    return {
        "batch": batch,
        "outcome": "measured",
        **peak_fields({"allocated": peaks, "reserved": peaks}),
        "param_bytes": PARAMS,
        "buffer_bytes": 0,
        "grad_bytes": PARAMS,
        "optimizer_bytes": PARAMS,
        "workspace_bytes": WORKSPACE,
        "activation_bytes": ACTIVATION_BYTES_PER_SAMPLE * batch,
        "autocast_weight_bytes": 0,
        "batch_bytes": BATCH_BYTES_PER_SAMPLE * batch,
    }


def probes_at(batches: list[int], parts: dict[str, tuple[float, float]]) -> list[dict]:
    return [probe(b, parts) for b in batches]


def out_of_memory(batch: int, failed_at_bytes: float | None = None) -> dict:
    """A probe or trial that ran out of memory (`failed_at_bytes` None: as recorded before GPUs said)."""
    return {"batch": batch, "outcome": "out_of_memory", "failed_at_bytes": failed_at_bytes, "error": "out of memory"}


def fits(batch: int, peak_bytes: float) -> dict:
    return {"batch": batch, "outcome": "fits", "peak_bytes": peak_bytes, "reserved_peak_bytes": peak_bytes}


# --- the model --------------------------------------------------------------------------------------

# Two parts with known lines: A = 100 + 1 b is the peak below b = 40, B = 20 + 3 b from there on.
BATCHES = [8, 16, 32]
TWO_PARTS = [[100 + b, 20 + 3 * b] for b in BATCHES]


def two_part_model() -> StepMemoryModel:
    return StepMemoryModel().fit(BATCHES, TWO_PARTS)


def test_every_part_gets_its_line_and_the_peak_is_their_envelope():
    model = two_part_model()
    np.testing.assert_allclose(model.intercepts_, [100, 20])
    np.testing.assert_allclose(model.slopes_, [1, 3])
    np.testing.assert_allclose(model.predict([8, 40, 100]), [108, 140, 320])
    assert model.line_at(10) == pytest.approx((100, 1))
    assert model.line_at(100) == pytest.approx((20, 3))
    assert model.departure_ == pytest.approx(0, abs=1e-12)


def test_growing_share_is_that_of_the_part_at_the_peak():
    model = two_part_model()
    assert model.growing_share(8) == pytest.approx(8 / 108)
    assert model.growing_share(100) == pytest.approx(300 / 320)


def test_largest_batch_is_the_largest_under_every_part():
    model = two_part_model()
    assert model.max_batch(200) == 60  # B: (200 - 20) / 3; A alone would allow 100
    assert model.max_batch(140) == 40
    assert model.max_batch(149) == 43
    assert model.max_batch(100) == 0  # A is 101 at batch 1


def test_a_fixed_part_above_the_budget_leaves_no_batch():
    model = StepMemoryModel().fit(BATCHES, [[*parts, 150] for parts in TWO_PARTS])
    assert model.max_batch(149) == 0
    assert model.max_batch(200) == 60


def test_a_line_needs_two_batches_and_memory_that_grows():
    with pytest.raises(ValueError, match="two batches"):
        StepMemoryModel().fit([32, 32], [100, 132])
    with pytest.raises(ValueError, match="does not grow with the batch"):
        StepMemoryModel().fit(BATCHES, [150, 150, 150]).max_batch(1000)


def test_a_kernel_switch_below_the_largest_probes_is_reported_not_fitted():
    batches = [16, 32, 64]
    peaks = [1000 + 10 * b + (200 if b == 16 else 0) for b in batches]  # a workspace only batch 16 picks
    model = StepMemoryModel().fit(batches, peaks)
    assert model.predict([1024])[0] == pytest.approx(1000 + 10 * 1024)
    assert model.departure_ == pytest.approx(200 / 1360)
    least_squares = LinearRegression().fit(np.reshape(batches, (-1, 1)), peaks)
    assert least_squares.predict([[1024]])[0] < 0.9 * (1000 + 10 * 1024)


def test_a_line_through_whole_step_peaks_underpredicts_where_the_peak_moves_between_parts():
    batches = [64, 128, 256]
    parts = [[2000 + 2 * b, 200 + 10 * b] for b in batches]  # the update is the peak up to b = 225, backward beyond
    assert StepMemoryModel().fit(batches, parts).predict([1024])[0] == pytest.approx(200 + 10 * 1024)
    whole_step = StepMemoryModel().fit(batches, np.max(parts, axis=1))
    assert whole_step.predict([1024])[0] < 0.6 * (200 + 10 * 1024)


# --- the probes -------------------------------------------------------------------------------------

FIXED_HEAVY = step_parts(1e6, 1e3)  # growing share 0.20 at b = 256, 0.67 at b = 2048
GROWING = step_parts(1e4, 1e3)  # growing share 0.96 at b = 256
ANY_CAP, ANY_BUDGET = 10**6, 10**12


def test_fit_probes_recovers_every_parts_line():
    model = fit_probes(probes_at([64, 128, 256], FIXED_HEAVY))
    np.testing.assert_allclose(model.intercepts_, [FIXED_HEAVY[part][0] for part in PARTS])
    np.testing.assert_allclose(model.slopes_, [FIXED_HEAVY[part][1] for part in PARTS])


def test_measured_probes_lie_below_the_smallest_failure_sorted_by_batch():
    probes = [probe(128, GROWING), out_of_memory(256), probe(64, GROWING), probe(512, GROWING), probe(32, GROWING)]
    assert [p["batch"] for p in measured(probes)] == [32, 64, 128]
    assert [p["batch"] for p in measured([probe(128, GROWING), probe(64, GROWING)])] == [64, 128]
    assert measured([probe(64, GROWING), {"batch": 32, "outcome": "budget_too_small", "error": ""}]) == []


@pytest.mark.parametrize(
    "probes, smaller",
    [
        ([out_of_memory(64), out_of_memory(128), out_of_memory(256)], 32),
        ([probe(64, GROWING), out_of_memory(128), out_of_memory(256)], 32),
        ([probe(64, GROWING), out_of_memory(128), out_of_memory(256), out_of_memory(32)], 16),
        ([out_of_memory(2), out_of_memory(1)], None),
    ],
)
def test_fewer_than_two_measured_probes_halve_the_smallest_batch_tried(probes, smaller):
    assert next_probe(probes, ANY_CAP, ANY_BUDGET) == smaller


@pytest.mark.parametrize("intercept, larger", [(256_000, None), (256_001, 512)])
def test_probes_double_while_growing_memory_is_less_than_its_share_of_the_peak(intercept, larger):
    probes = probes_at([64, 128, 256], step_parts(intercept, 3_000))  # growing share at b = 256: 768 / (256 + 768)
    assert (fit_probes(probes).growing_share(256) < GROWING_SHARE) == (larger is not None)
    assert next_probe(probes, ANY_CAP, ANY_BUDGET) == larger


def test_no_probe_once_growing_memory_dominates():
    assert next_probe(probes_at([64, 128, 256], GROWING), ANY_CAP, ANY_BUDGET) is None


@pytest.mark.parametrize(
    "cap, budget, larger",
    [
        (512, 1e6 + 1e3 * 512, 512),
        (511, 1e6 + 1e3 * 512, None),  # the training set is smaller
        (512, 1e6 + 1e3 * 512 - 1, None),  # the model expects it not to fit
    ],
)
def test_no_probe_beyond_the_training_set_or_the_budget(cap, budget, larger):
    assert next_probe(probes_at([64, 128, 256], FIXED_HEAVY), cap, budget) == larger


def test_no_probe_at_a_batch_that_failed():
    assert next_probe([*probes_at([64, 128], FIXED_HEAVY), out_of_memory(256)], ANY_CAP, ANY_BUDGET) is None


def test_probing_stops_after_max_probes():
    batches = [64 * 2**i for i in range(MAX_PROBES)]
    assert next_probe(probes_at(batches[:-1], FIXED_HEAVY), ANY_CAP, ANY_BUDGET) == batches[-1]
    assert next_probe(probes_at(batches, FIXED_HEAVY), ANY_CAP, ANY_BUDGET) is None


# --- verification trials ----------------------------------------------------------------------------


def linear_model(intercept: float = 1000.0, slope: float = 10.0) -> StepMemoryModel:
    return StepMemoryModel().fit([64, 128], [intercept + slope * b for b in (64, 128)])


def test_the_first_trial_is_the_models_largest_batch_within_the_training_set():
    assert next_trial(linear_model(), 2000, [], ANY_CAP) == 100
    assert next_trial(linear_model(), 2000, [], cap=60) == 60
    assert next_trial(linear_model(), 1009, [], ANY_CAP) is None


def test_a_trial_that_confirms_the_model_settles_it():
    trials = [fits(100, 2000)]
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) is None
    assert settle(trials, fallback=64) == (100, True)


def test_a_trial_below_the_prediction_corrects_upwards_once():
    trials = [fits(100, 1800)]  # the slope is 8, not 10
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) == 125
    trials.append(fits(125, 1900))  # less again: another trial would go higher, but one correction is enough
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) is None
    assert settle(trials, fallback=64) == (125, True)


def test_no_trial_exceeds_the_training_set():
    assert next_trial(linear_model(), 2000, [fits(60, 1600)], cap=60) is None
    assert next_trial(linear_model(), 2000, [fits(40, 1300)], cap=60) == 60


@pytest.mark.parametrize(
    "failed_at_bytes, retry",
    [
        (2250, 80),  # the slope is at least 12.5
        (2010, 90),  # just above the budget (the block that failed was small): 10 % down, not 1 sample
        (None, 90),  # unknown: 10 % down
        (1500, 90),  # the correction would go higher: 10 % down
    ],
)
def test_a_trial_out_of_memory_retries_well_below_it(failed_at_bytes, retry):
    assert next_trial(linear_model(), 2000, [out_of_memory(100, failed_at_bytes)], ANY_CAP) == retry


def test_after_running_out_of_memory_a_trial_that_fits_corrects_upwards_below_the_failure():
    trials = [out_of_memory(100, 2250), fits(80, 1800)]  # 80 shows the slope is 10: 100 would fit, but failed
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) == 99
    trials.append(fits(99, 1990))
    assert len(trials) == MAX_VERIFICATION_TRIALS and next_trial(linear_model(), 2000, trials, ANY_CAP) is None
    assert settle(trials, fallback=64) == (99, True)


def test_trials_that_all_run_out_of_memory_go_on_down_until_the_last():
    trials = [out_of_memory(100, 2010), out_of_memory(90, 2005)]
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) == 81
    trials.append(out_of_memory(81, 2001))
    assert next_trial(linear_model(), 2000, trials, ANY_CAP) is None


def test_no_retry_falls_to_a_batch_that_fit():
    assert next_trial(linear_model(), 2000, [fits(95, 1800), out_of_memory(100, 2010)], ANY_CAP) is None


def format_size(size: int) -> str:
    """A size as c10's format_size writes it in an out-of-memory message."""
    if size <= 1024:
        return f"{size} bytes"
    unit = next(unit for unit in ("KiB", "MiB", "GiB") if unit == "GiB" or size <= 1024 * UNIT_BYTES[unit])
    return f"{size / UNIT_BYTES[unit]:.2f} {unit}"


UNIT_BYTES = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def test_gpu_trials_settle_near_the_cards_largest_batch(monkeypatch):
    """A card whose step needs 2 GiB + 50 MiB a sample (in ten 5 MiB blocks a sample), sized by a model that expects
    48 MiB: 20 GiB hold batch 368. The allocator fails at the first block beyond the cap; the retry goes 10 % down,
    fits, and shows the slope. Without reading the error the retry was one sample down and failed too."""
    need = lambda batch: 2 * GiB + 50 * MiB * batch  # noqa: E731

    def trial_step(job, batch, budget, ddp):
        if need(batch) <= budget:
            return fits(batch, need(batch))
        block = 5 * MiB * batch
        reserved = 2 * GiB + block * ((budget - 2 * GiB) // block)
        sizes = (format_size(block), format_size(reserved - 3 * MiB), format_size(3 * MiB))
        raise torch.OutOfMemoryError(cuda_out_of_memory_message(*sizes, allowed=f"{format_size(budget)} allowed; "))

    monkeypatch.setattr(memory, "trial_step", trial_step)
    monkeypatch.setattr(memory, "_device", lambda job: CUDA)
    model, available, trials = (
        StepMemoryModel().fit([64, 128], [2 * GiB + 48 * MiB * b for b in (64, 128)]),
        20 * GiB,
        [],
    )
    while (batch := next_trial(model, available, trials, ANY_CAP)) is not None:
        trials.append(
            memory._answer_in_process("trial", dict(job=default_job(), batch=batch, budget=available, ddp=False))
        )
    assert [(t["batch"], t["outcome"]) for t in trials] == [(384, "out_of_memory"), (345, "fits"), (368, "fits")]
    assert trials[0]["failed_at_bytes"] > available
    assert settle(trials, fallback=128) == (368, True)


def test_settle_keeps_the_largest_trial_that_fit_else_the_fallback_unverified():
    failed = out_of_memory(100, 2250)
    assert settle([failed, fits(80, 1990)], fallback=64) == (80, True)
    assert settle([failed, out_of_memory(80, 2100)], fallback=64) == (64, False)
    assert settle([], fallback=64) == (64, False)


# --- what the peak is made of -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, intercept, slope",
    [(100, 5000, 100), (10, 7000, 10)],  # the part at the peak: 5000 + 100 b from b = 23 on, 7000 + 10 b below
)
def test_composition_splits_the_line_at_the_probes_batch(batch, intercept, slope):
    model = StepMemoryModel().fit([64, 128], [[5000 + 100 * b, 7000 + 10 * b] for b in (64, 128)])
    at_probe = {
        "batch": batch,
        "param_bytes": 1000,
        "buffer_bytes": 100,
        "optimizer_bytes": 1000,
        "batch_bytes": BATCH_BYTES_PER_SAMPLE * batch,
        "activation_bytes": ACTIVATION_BYTES_PER_SAMPLE * batch,
    }
    parts = composition(model, {**at_probe, "workspace_bytes": 200, "autocast_weight_bytes": 500}, 300, 400)
    assert parts["fixed_bytes"] == pytest.approx(
        {
            "parameters_and_buffers": 1100,
            "optimizer_state": 1000,
            "workspace": 200,
            "autocast_weight_copies": 500,
            "ddp_buckets": 300,
            "nccl_ring_buffers": 400,
            "gradients_and_temporaries": intercept - 2800,
        }
    )
    assert parts["per_sample_bytes"] == pytest.approx(
        {
            "batch": BATCH_BYTES_PER_SAMPLE,
            "saved_activations": ACTIVATION_BYTES_PER_SAMPLE,
            "temporaries": slope - BATCH_BYTES_PER_SAMPLE - ACTIVATION_BYTES_PER_SAMPLE,
        }
    )


# --- memory.json and bad budgets --------------------------------------------------------------------

# The update is the peak at b = 64, an ordinary step's backward pass from b = 82 on.
SUMMARY_PARTS = {**step_parts(2e6, 5e4), "update/update": (6e6, 1e3)}


def summarise_with(job: dict, probes: list[dict], trials: list[dict], train: int = 100_000, ring: int = 0) -> dict:
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


def job_with(device_memory_gb: float, nodes: int = 2) -> dict:
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


def test_the_reserved_figure_sizes_the_batch_and_both_figures_are_reported():
    """A caching allocator reserves 10 % more than it allocates, plus a 1 MB segment: the batch is sized on that."""
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
    assert result["decided_by"] == "reserved"
    assert result["predicted_max_batch"] == int((0.9 * GB - 1.1 * 2e6 - 1e6) // (1.1 * 5e4))
    assert result["fit"]["slope_bytes_per_sample"] == pytest.approx(1.1 * 5e4)
    assert result["fit_allocated"]["slope_bytes_per_sample"] == pytest.approx(5e4)
    assert result["composition"]["per_sample_bytes"]["temporaries"] == pytest.approx(
        5e4 - BATCH_BYTES_PER_SAMPLE - ACTIVATION_BYTES_PER_SAMPLE
    )


def test_memory_the_card_holds_outside_the_allocator_is_taken_off_the_budget():
    """A 1 GB budget on a 1 GB card whose CUDA context holds 100 MB: the steps may fill 90 % of 900 MB."""
    probes = [{**probe(b, SUMMARY_PARTS), "card_bytes": GB, "outside_allocator_bytes": 1e8} for b in (64, 128, 256)]
    result = summarise_with(job_with(1.0, nodes=1), probes, [])
    assert result["usable_bytes"] == 0.9 * (GB - 1e8) and result["outside_allocator_bytes"] == 1e8
    assert result["predicted_max_batch"] == int((0.9 * (GB - 1e8) - 2e6) // 5e4)
    assert memory.room_for_steps(job_with(0.5, nodes=1), int(0.5 * GB), probes) == 0.45 * GB  # the budget is less


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


# --- real probes and trials -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_probe() -> dict:
    return run_in_fresh_process("measure", job=default_job(), batch=64)


def test_a_probe_measures_every_part_of_the_steady_steps(real_probe):
    assert real_probe["outcome"] == "measured" and set(real_probe["peaks"]) == set(PARTS)
    assert real_probe["peak_bytes"] == max(real_probe["peaks"].values())
    assert min(real_probe["peaks"].values()) > real_probe["param_bytes"] + real_probe["optimizer_bytes"]
    assert real_probe["activation_bytes"] > 0
    assert real_probe["grad_bytes"] == real_probe["param_bytes"]
    # SGD's momentum, counted from its tensors; fp32 makes no weight copies; the CPU has no NCCL.
    assert real_probe["optimizer_bytes"] == real_probe["param_bytes"]
    assert real_probe["autocast_weight_bytes"] == 0 and real_probe["collective_library_bytes"] == 0


def test_a_bf16_probe_counts_autocasts_weight_copies_apart_from_the_activations(real_probe):
    bf16 = run_in_fresh_process("measure", job=default_job(train={"precision": "bf16"}), batch=64)
    assert 0 < bf16["autocast_weight_bytes"] <= bf16["param_bytes"] / 2  # bf16 copies of the weights, not biases
    assert bf16["activation_bytes"] < real_probe["activation_bytes"]
    assert bf16["optimizer_bytes"] == real_probe["optimizer_bytes"]


def test_a_trial_runs_out_of_memory_below_the_probes_peak_and_reaches_it_above(real_probe):
    job = default_job()
    tight = (real_probe["param_bytes"] + real_probe["peak_bytes"]) // 2  # holds the model, not the step
    with ThreadPoolExecutor(max_workers=2) as pool:
        too_small, large = pool.map(
            lambda budget: run_in_fresh_process("trial", job=job, batch=64, budget=budget, ddp=False),
            [tight, budget_bytes(job, torch.device("cpu"))],
        )
    assert too_small["outcome"] == "out_of_memory" and too_small["failed_at_bytes"] > tight
    assert large["outcome"] == "fits"
    assert large["peak_bytes"] == pytest.approx(real_probe["peak_bytes"], rel=0.01)


@pytest.mark.parametrize(("gpus_per_node", "at_once"), [(0, 2), (1, 1)])
def test_probes_share_the_cpu_two_at_a_time_but_a_gpu_holds_one(monkeypatch, gpus_per_node, at_once):
    """Each probe may use the whole budget: two on one GPU would each see half of it."""
    running, most = [], []

    def probe_slowly(kind, job, batch):
        running.append(batch)
        most.append(len(running))
        time.sleep(0.2)
        running.remove(batch)
        return {"batch": batch, "outcome": "out_of_memory", "failed_at_bytes": None}

    monkeypatch.setattr(memory, "run_in_fresh_process", probe_slowly)
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0, 1})
    job = default_job()  # GPUs set after validation, which refuses them on the local launcher of a machine without
    job["resources"]["gpus_per_node"] = gpus_per_node
    run_probes(job, cap=1000, budget=10**9)
    assert max(most) == at_once


def test_a_gpu_jobs_probe_never_runs_on_the_cpu_in_its_stead(monkeypatch):
    """CUDA unusable where the probe runs: an error naming this host's CUDA, not a CPU-sized budget."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = default_job()
    job["resources"]["gpus_per_node"] = 1
    with pytest.raises(DeviceError, match="CUDA unusable"):
        memory._device(job)
    job["resources"]["gpus_per_node"] = 0
    assert memory._device(job).type == "cpu"
