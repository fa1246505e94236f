"""bench/loader_pace.py: a loader slower than the step, its data set behind a slow file system, and its verdicts."""

from __future__ import annotations

import json

import pytest
from tula_bench import loader_pace, slow_storage


def _figures(median: float) -> dict:
    return {f: {"median_rel_error": median} for f in loader_pace.FIGURES}


def test_the_step_alone_is_the_prediction_without_the_profiles_loader_timing():
    runs = [{"profile": {"loader": {"workers": 3, "period_s": 0.05}, "median": {"step_s": 0.02}}}]
    alone = loader_pace.without_loader(runs)
    assert alone[0]["profile"]["loader"] is None and runs[0]["profile"]["loader"]["period_s"] == 0.05


def test_the_loader_bound_case_is_judged_on_its_target_and_the_control_on_staying_the_same():
    cases = {
        "loader_bound": {"figures": _figures(0.04), "figures_step_alone": _figures(0.33)},
        "control": {"figures": _figures(0.05), "figures_step_alone": _figures(0.05)},
    }
    found = loader_pace.verdicts(cases)
    assert set(found) == {"loader_bound_whole_run", "loader_bound_steady_epoch", "control_unchanged"}
    assert all(v["met"] for v in found.values())
    cases["control"]["figures"] = _figures(0.08)  # the floor moved a configuration whose loader keeps up
    assert not loader_pace.verdicts(cases)["control_unchanged"]["met"]


def test_the_slow_data_set_serves_the_digits_repeated_to_its_size_each_after_its_latency(monkeypatch):
    slept = []
    monkeypatch.setattr(slow_storage.time, "sleep", slept.append)
    train, test, classes = slow_storage.digits_behind_latency(8, latency_ms=0.5, size=3000)
    assert (len(train), len(test), classes) == (2400, 600, 10)
    image, label = train[1797]  # the second pass starts over
    assert image.shape == (1, 8, 8) and label == train[0][1] and slept == [0.0005, 0.0005]
    with pytest.raises(ValueError, match="image_size 16"):
        slow_storage.digits_behind_latency(16)
    json.dumps(loader_pace.case_job("control", 0.0).as_dict())  # a valid job: the config accepts the data set


def test_the_smoke_case_is_a_valid_job_on_its_few_images():
    job = loader_pace.case_job("loader_bound", loader_pace.LATENCY_MS["loader_bound"], loader_pace.SMOKE_SIZE)
    assert job.data.kwargs["size"] == loader_pace.SMOKE_SIZE < loader_pace.SIZE
