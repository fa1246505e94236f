"""loader_rate.py: the pace of a rank's loader workers, a floor under the step, on synthetic timings."""

import numpy as np
import pytest

from tula_hpc.performance.loader_rate import LoaderRate, fit_loader_rate


def _profile(batch: int, loader: dict | None) -> dict:
    return {"per_device_batch": batch, "loader": loader}


def test_the_line_through_the_profiled_batches_is_recovered():
    batches = np.array([16, 32, 64])
    rate = LoaderRate(workers=4).fit(batches, 0.002 + 0.001 * batches)
    assert rate.intercept_s_ == pytest.approx(0.002) and rate.per_sample_s_ == pytest.approx(0.001)
    assert rate.predict([128]) == pytest.approx([0.002 + 0.128])


def test_one_profiled_batch_makes_the_pace_proportional_to_the_batch():
    rate = LoaderRate(workers=2).fit([32, 32], [0.064, 0.096])
    assert rate.intercept_s_ == 0.0 and rate.per_sample_s_ == pytest.approx(0.0025)
    assert rate.predict([64, 16]) == pytest.approx([0.16, 0.04])


def test_without_workers_there_is_no_floor():
    assert LoaderRate(workers=0).fit([16, 32], [1.0, 2.0]).predict([16, 32]).tolist() == [0.0, 0.0]


def test_profiles_that_timed_their_loader_give_the_floor_with_their_workers():
    rate = fit_loader_rate([_profile(b, {"workers": 3, "period_s": 0.001 * b}) for b in (16, 64)])
    assert rate.notes_ == [] and rate.coefficients() == {
        "workers": 3,
        "intercept_s": pytest.approx(0.0, abs=1e-12),
        "per_sample_s": pytest.approx(0.001),
    }
    assert rate.predict([30]) == pytest.approx([0.03])


def test_profiles_without_workers_hold_no_floor_and_need_no_note():
    rate = fit_loader_rate([_profile(16, None), _profile(64, None)])
    assert rate.notes_ == [] and rate.predict([64]).tolist() == [0.0]


def test_profiles_recorded_before_the_loader_was_timed_hold_no_floor_and_say_so():
    rate = fit_loader_rate([{"per_device_batch": 16}])
    [note] = rate.notes_
    assert rate.predict([64]).tolist() == [0.0]
    assert "no profile timed its loader" in note
