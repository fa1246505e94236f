"""memory_model: one line per part of the steady steps and their envelope, the probes and trials that settle the
largest per-device batch, what the peak is made of; synthetic probes with known lines."""

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from tula_hpc.memory.model import (
    BRACKET,
    GROWING_SHARE,
    MAX_BRACKET_TRIALS,
    MAX_PROBES,
    MAX_VERIFICATION_TRIALS,
    StepMemoryModel,
    composition,
    cuda_choice,
    fit_probes,
    measured,
    next_bracket_trial,
    next_probe,
    next_trial,
    settle,
)
from tula_hpc.memory.step_parts import PARTS
from tula_hpc.profiling.memory_probes import peak_fields

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


def test_settle_keeps_the_largest_trial_that_fit_else_the_fallback_unverified():
    failed = out_of_memory(100, 2250)
    assert settle([failed, fits(80, 1990)], fallback=64) == (80, True)
    assert settle([failed, out_of_memory(80, 2100)], fallback=64) == (64, False)
    assert settle([], fallback=64) == (64, False)


# --- CUDA: trials that bracket the card's limit -------------------------------------------------------


def card_trial(batch: int, limit: int, retries: int = 0) -> dict:
    """A trial on a card where every batch up to `limit` runs."""
    events = {"num_alloc_retries": retries if batch <= limit else retries + 1, "num_ooms": int(batch > limit)}
    outcome = "fits" if batch <= limit else "out_of_memory"
    return {"batch": batch, "outcome": outcome, "allocator_events": events}


def bracket(limit: int, cap: int = ANY_CAP, available: int = 2000) -> list[dict]:
    trials: list[dict] = []
    while (batch := next_bracket_trial(linear_model(), available, trials, cap)) is not None:
        trials.append(card_trial(batch, limit))
    return trials


@pytest.mark.parametrize("limit", [60, 95, 99, 100, 104, 130, 170])  # the allocated line says 100
def test_cuda_trials_end_with_a_fit_within_one_percent_of_a_failure_never_above_it(limit):
    trials = bracket(limit)
    fitted = max(t["batch"] for t in trials if t["outcome"] == "fits")
    failed = min(t["batch"] for t in trials if t["outcome"] != "fits")
    assert fitted == limit and failed - fitted <= max(1, BRACKET * fitted)
    assert trials[0]["batch"] == 100 and len(trials) <= MAX_BRACKET_TRIALS


def test_cuda_trials_stop_at_the_training_set_where_it_fits():
    trials = bracket(limit=500, cap=103)
    assert trials[-1] == card_trial(103, 500) and all(t["batch"] <= 103 for t in trials)


def test_cuda_choice_measures_the_allowance_and_takes_the_headroom_off_the_limit():
    """Room 2000 bytes, the allocated line 1000 + 10 b: the card ran 95 and not 96, so the allocator could not give
    back 2000 - 1950 = 50 bytes there; 10 % headroom of a 2000-byte budget leaves 1750 allocated bytes: b = 75."""
    trials = bracket(limit=95)
    choice = cuda_choice(linear_model(), trials, room=2000, budget=2000, headroom=0.0, cap=ANY_CAP)
    assert choice["limit"] == choice["chosen"] == 95 and choice["smallest_failed"] == 96
    assert choice["allowance_bytes"] == pytest.approx(50) and choice["limited_by_memory"]
    with_headroom = cuda_choice(linear_model(), trials, room=2000, budget=2000, headroom=0.1, cap=ANY_CAP)
    assert with_headroom["chosen"] == 75 and with_headroom["limit"] == 95


def test_cuda_choice_keeps_the_largest_batch_free_of_allocator_retries_apart():
    trials = [card_trial(100, 95), card_trial(97, 95), card_trial(94, 95, retries=2), card_trial(90, 95)]
    choice = cuda_choice(linear_model(), trials, room=2000, budget=2000, headroom=0.0, cap=ANY_CAP)
    assert choice["limit"] == 94 and choice["without_retry"] == 90


def test_cuda_choice_where_the_training_set_limits_measures_no_allowance():
    choice = cuda_choice(linear_model(), bracket(500, cap=103), room=2000, budget=2000, headroom=0.0, cap=103)
    assert choice["chosen"] == 103 and choice["allowance_bytes"] is None and not choice["limited_by_memory"]


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
