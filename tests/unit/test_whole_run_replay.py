"""bench/whole_run_replay.py: recorded whole training runs predicted again by today's code and judged per record."""

from __future__ import annotations

import copy
import json

import pytest
from tula_bench import whole_run
from tula_bench import whole_run_replay as replay

RECORD = whole_run.CASES / "h200_resnet18_32_fp32.json"


def _record() -> dict:
    return json.loads(RECORD.read_text())


def _predicting(monkeypatch, epochs: list[float]) -> None:
    def predicted(job, run, train_samples):
        return {"time_s": sum(epochs), "epoch_time_s": epochs, "steps_only_s": sum(epochs), "terms": {}}

    monkeypatch.setattr(whole_run, "predicted", predicted)


def _runs(*epochs: list[float]) -> list[dict]:
    return [
        {"model": "m", "nodes": 1, "per_device_batch": 32, "repeat": i, "train_time_s": sum(e), "epoch_time_s": e}
        for i, e in enumerate(epochs)
    ]


def test_every_recorded_run_is_predicted_again_from_its_own_profile():
    row = replay.replay_record("h200", _record())
    assert row["runs"] == 3 and [r["repeat"] for r in row["predicted"]] == [0, 1, 2]
    assert all(len(r["predicted"]["epoch_time_s"]) == len(r["epoch_time_s"]) == 3 for r in row["predicted"])
    # The cold machine's first CUDA process (repeat 0's profile: first step 1.04 s, later ones 0.6 s) predicts the
    # longest first epoch.
    first = [r["predicted"]["epoch_time_s"][0] for r in row["predicted"]]
    assert first[0] == max(first)
    assert row["figures"]["whole_run"]["noise_floor"] > 0 and "whole_run_over_noise_floor" in row["verdicts"]


def test_a_record_is_judged_on_its_epochs_against_the_targets(monkeypatch):
    """Measured first epochs 1.0 s and steady 0.5 s; predicted 1.2 s and 0.52 s: 20 % (met, <= 25 %) and 4 %."""
    _predicting(monkeypatch, [1.2, 0.52, 0.52])
    record = {"job": _record()["job"], "train_samples": 1258, "runs": _runs([1.0, 0.5, 0.5])}
    row = replay.replay_record("one", record)
    assert row["verdicts"]["first_epoch_median"]["figure"] == pytest.approx(0.2)
    assert row["verdicts"]["first_epoch_median"]["met"] and row["verdicts"]["steady_epoch_median"]["met"]
    assert row["verdicts"]["steady_epoch_median"]["figure"] == pytest.approx(0.04)
    # One run of its configuration: no noise floor, so the whole run is reported, not judged against one.
    assert row["figures"]["whole_run"]["noise_floor"] is None and "whole_run_over_noise_floor" not in row["verdicts"]


def test_the_summary_names_the_worst_record_of_each_target(monkeypatch):
    _predicting(monkeypatch, [1.0, 0.5, 0.5])
    job = _record()["job"]
    close = replay.replay_record("close", {"job": job, "train_samples": 1, "runs": _runs([1.0, 0.5, 0.5])})
    far = replay.replay_record("far", {"job": job, "train_samples": 1, "runs": _runs([1.0, 0.4, 0.4])})
    summary = replay.summarise([close, far])
    assert summary["worst"]["steady_epoch_median"]["record"] == "far"
    assert summary["worst"]["steady_epoch_median"]["figure"] == pytest.approx(0.25)
    assert not summary["all_met"] and replay.summarise([close])["all_met"]


def test_the_record_is_left_as_it_was(monkeypatch):
    record = _record()
    before = copy.deepcopy(record)
    replay.replay_record("h200", record)
    assert record == before


def test_a_file_of_another_kind_is_refused_naming_it(tmp_path):
    memory_case = tmp_path / "case.json"
    memory_case.write_text(json.dumps({"job": {}, "memory": {}, "truth": {}}))
    with pytest.raises(SystemExit, match=r"case\.json: not a whole-run case \(no train_samples, runs\)"):
        replay.read_record(memory_case)
    with pytest.raises(SystemExit, match="no whole-run case"):
        replay.main(["--cases", str(tmp_path / "empty"), "--out", str(tmp_path / "out.json")])


def test_a_kept_case_holds_the_measured_side_only():
    job = replay.Job.from_dict(replay.merged(replay.bench_job().as_dict(), _record()["job"]))
    runs = [{**run, "predicted": {"time_s": 1.0}} for run in _record()["runs"]]
    case = whole_run.case_record("what", {"device": {"name": "x"}}, job, 1258, runs)
    assert not [run for run in case["runs"] if "predicted" in run] and case["job"] == job.as_dict()
    assert set(case) >= {"job", "train_samples", "runs"}
