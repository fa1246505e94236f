"""Stage probe_memory: the step's memory timeline fitted point by point, trials that verify it, memory.json."""

import numpy as np
import pytest
import yaml
from sklearn.linear_model import LinearRegression

from tests.conftest import default_job, job_config
from tula_hpc.budget import GB
from tula_hpc.config import ConfigError, load_config
from tula_hpc.memory import (
    StepMemoryModel,
    fit_probes,
    next_trial,
    run_in_fresh_process,
    settle,
    summarise,
)
from tula_hpc.stage import StageError

# --- the model on synthetic timelines with known answers ---------------------------------------------

# Two points of a step's timeline: A = 100 + 1 b (the peak at small batches), B = 20 + 3 b (from b = 40 on).
PROBES = [8, 16, 32]
TIMELINES = [[50, 100 + b, 60, 20 + 3 * b, 10] for b in PROBES]


def test_every_timeline_point_is_fitted_and_the_peak_is_their_envelope():
    model = StepMemoryModel().fit(PROBES, TIMELINES)
    np.testing.assert_allclose(model.intercepts_, [50, 100, 60, 20, 10], atol=1e-9)
    np.testing.assert_allclose(model.slopes_, [0, 1, 0, 3, 0], atol=1e-12)
    np.testing.assert_allclose(model.predict([8, 40, 100]), [108, 140, 320])
    assert model.line_at(100) == pytest.approx((20, 3))
    assert model.rel_residual_ == pytest.approx(0, abs=1e-12)


def test_a_line_through_the_probes_peaks_underpredicts_where_the_peak_moves():
    peaks = [max(t) for t in TIMELINES]
    line = StepMemoryModel().fit(PROBES, peaks)
    reference = LinearRegression().fit(np.reshape(PROBES, (-1, 1)), peaks)
    assert line.predict([100])[0] == pytest.approx(reference.predict([[100]])[0]) == pytest.approx(200)
    assert StepMemoryModel().fit(PROBES, TIMELINES).predict([100])[0] == pytest.approx(320)


def test_largest_batch_is_the_largest_under_every_point():
    model = StepMemoryModel().fit(PROBES, TIMELINES)
    assert model.max_batch(200) == 60  # B: (200 - 20) / 3; A alone would allow 100
    assert model.max_batch(140) == 40
    assert model.max_batch(100) == 0  # A is 101 at batch 1
    assert model.max_batch(59) == 0  # a fixed point above the budget


def test_probes_whose_steps_do_not_align_fall_back_to_the_peak_line():
    probes = [{"batch": b, "timeline": t, "measured_peak_bytes": max(t)} for b, t in zip(PROBES, TIMELINES)]
    assert len(fit_probes(probes).slopes_) == 5
    probes[0]["timeline"] = probes[0]["timeline"][:-1]
    model = fit_probes(probes)
    assert len(model.slopes_) == 1 and model.predict([100])[0] == pytest.approx(200)


# --- verification trials ---------------------------------------------------------------------------

CAP = 10**6


def _linear_model(intercept=1000.0, slope=10.0) -> StepMemoryModel:
    return StepMemoryModel().fit([1, 2, 3], [intercept + slope * b for b in (1, 2, 3)])


def test_a_trial_that_confirms_the_model_settles_in_one_step():
    model = _linear_model()
    assert next_trial(model, 2000, [], CAP) == 100
    trials = [{"batch": 100, "outcome": "fits", "peak_bytes": 2000}]
    assert next_trial(model, 2000, trials, CAP) is None
    assert settle(trials) == (100, True)


def test_a_trial_below_the_prediction_corrects_upwards_and_stops_after_two():
    model = _linear_model()
    trials = [{"batch": 100, "outcome": "fits", "peak_bytes": 1800}]  # slope was 8, not 10
    assert next_trial(model, 2000, trials, CAP) == 125
    trials.append({"batch": 125, "outcome": "out_of_memory", "failed_at_bytes": 2001})
    assert next_trial(model, 2000, trials, CAP) is None
    assert settle(trials) == (100, True)


def test_no_trial_exceeds_the_training_set():
    model = _linear_model()
    assert next_trial(model, 2000, [], cap=60) == 60
    assert next_trial(model, 2000, [{"batch": 60, "outcome": "fits", "peak_bytes": 1600}], cap=60) is None
    assert next_trial(model, 2000, [{"batch": 40, "outcome": "fits", "peak_bytes": 1300}], cap=60) == 60


def test_a_trial_out_of_memory_corrects_downwards():
    model = _linear_model()
    trials = [{"batch": 100, "outcome": "out_of_memory", "failed_at_bytes": 2250}]  # slope at least 12.5
    assert next_trial(model, 2000, trials, CAP) == 80
    assert settle(trials + [{"batch": 80, "outcome": "fits", "peak_bytes": 1990}]) == (80, True)
    assert settle(trials + [{"batch": 80, "outcome": "out_of_memory", "failed_at_bytes": 2100}]) == (40, False)


# --- memory.json and bad budgets -------------------------------------------------------------------


def _measured(intercept=2e6, slope=5e4, params=6e5, trials=None):
    probes = [
        {
            "batch": b,
            "outcome": "measured",
            "measured_peak_bytes": intercept + slope * b,
            "param_bytes": params,
            "grad_bytes": params,
            "timeline": [intercept / 2, intercept + slope * b, 1.0],
        }
        for b in (32, 48, 64)
    ]
    return {
        "probes": probes,
        "trials": trials or [{"batch": 1, "outcome": "fits", "peak_bytes": 1}],
        "dataset": {"train": 1000, "val": 100, "test": 100},
    }


def test_summary_sizes_the_batch_for_budget_headroom_and_ddp_buckets():
    job = default_job(resources={"device_memory_gb": 1.0, "memory_headroom": 0.1})
    proposed = int((0.9 * GB - 6e5 - 2e6) // 5e4)  # two nodes in the search space: DDP's buckets hold 6e5 bytes
    result = summarise(job, _measured(trials=[{"batch": proposed, "outcome": "fits", "peak_bytes": 0.9 * GB - 6e5}]))
    assert result["predicted_max_batch"] == result["max_batch_per_device"] == proposed and result["verified"]
    assert result["ddp_bucket_bytes"] == 6e5 and result["usable_bytes"] == 0.9 * GB
    assert result["fit"]["intercept_bytes"] == pytest.approx(2e6 + 6e5)
    assert result["fit"]["slope_bytes_per_sample"] == pytest.approx(5e4)
    assert all("timeline" not in p for p in result["probes"])


def test_budget_smaller_than_one_sample_names_the_job_and_the_bytes_needed():
    with pytest.raises(
        StageError,
        match=r"job 'digits-cnn': field 'resources.device_memory_gb': 0.002 GB .* "
        r"even at batch 1: it needs 2,650,000 bytes",
    ):
        summarise(default_job(resources={"device_memory_gb": 0.002}), _measured())


def test_zero_budget_is_refused_when_the_config_is_read(tmp_path):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(job_config(resources={"device_memory_gb": 0})))
    with pytest.raises(
        ConfigError,
        match=r"job 'digits-cnn': field 'resources.device_memory_gb': 0 is less than or "
        r"equal to the minimum of 0",
    ):
        load_config([tmp_path / "jobs.yaml"])


def test_probe_batches_below_the_gradient_scaling_reference_are_refused(tmp_path):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(job_config(resources={"memory_probe_batches": [16, 32, 64]})))
    with pytest.raises(ConfigError, match=r"field 'resources.memory_probe_batches': 16 is below train.ags.small_batch"):
        load_config([tmp_path / "jobs.yaml"])


# --- real measurements ------------------------------------------------------------------------------


def test_components_at_the_peak_sum_to_the_measured_total():
    job = default_job(train={"strategy": "lbt"})
    probe = run_in_fresh_process("measure", job=job, batch=48)
    parts = probe["at_peak"]
    assert sum(parts.values()) == probe["measured_peak_bytes"] == probe["allocator_peak_bytes"]
    assert parts["model"] == probe["param_bytes"] + probe["buffer_bytes"]
    assert parts["optimizer_state"] == probe["optimizer_bytes"] == probe["param_bytes"]  # one momentum buffer
    assert parts["batch"] == probe["batch_bytes"] == 48 * (8 * 8 * 4 + 8)
    assert 0 < parts["gradients"] <= probe["grad_bytes"] == probe["param_bytes"]
    assert 0 < parts["activations"] <= probe["activation_bytes"]
    assert parts["workspace"] > 0
    assert probe["timeline"][-1] < max(probe["timeline"]) == probe["measured_peak_bytes"]
