"""The files stages hand each other: written and read back field by field, and a file another version wrote (a
field missing or unknown) is a clear error naming the file and the field, not a KeyError deep in the next stage."""

from __future__ import annotations

import json

import pytest

from tests.conftest import default_job
from tula_hpc.core.atomic_files import StageInputError
from tula_hpc.core.records import Selection, TrainSummary

SELECTION = {
    "job": "digits-cnn",
    "objective": "knee",
    "pricing": "node_hour",
    "knee_method": "kneedle",
    "knee_min_saving": 0.1,
    "chosen": {"nodes": 2, "batch": 256, "time_s": 10.0},
    "knees": {"kneedle": 256, "model": 128},
    "runners_up": [{"nodes": 1, "batch": 128, "time_s": 12.0}],
    "constraints": {"max_nodes": None},
    "feasible": 2,
    "candidates": 2,
    "best_time_curve": [{"batch": 256, "nodes": 2, "time_s": 10.0}],
}


def test_a_record_reads_back_what_was_written(tmp_path):
    record = Selection(**SELECTION, knee_used="kneedle", predicted={"time_s": 10.0, "cost": 1.0, "to": "epochs"})
    record.write(tmp_path / "selection.json")
    assert Selection.read(tmp_path / "selection.json") == record
    assert json.loads((tmp_path / "selection.json").read_text())["chosen"] == SELECTION["chosen"]


def test_an_optional_field_left_out_is_not_written_and_reads_as_none(tmp_path):
    Selection(**SELECTION).write(tmp_path / "selection.json")
    assert "predicted" not in json.loads((tmp_path / "selection.json").read_text())
    assert Selection.read(tmp_path / "selection.json").predicted is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.pop("chosen"), "field 'chosen' is missing"),
        (lambda d: d.update(chosen_config={}), r"unknown field\(s\) chosen_config"),
    ],
)
def test_a_file_of_another_shape_names_the_file_and_the_field(tmp_path, change, named):
    plain = dict(SELECTION)
    change(plain)
    path = tmp_path / "selection.json"
    path.write_text(json.dumps(plain))
    with pytest.raises(StageInputError, match=f"selection.json: Selection: {named}"):
        Selection.read(path)


def test_a_selection_by_hand_is_one_the_train_stage_reads(tmp_path):
    job = default_job()
    chosen = {"nodes": 2, "batch": 128, "per_device_batch": 64}
    Selection.by_hand(job, chosen).write(tmp_path / "selection.json")
    read = Selection.read(tmp_path / "selection.json")
    assert read.chosen == chosen and read.job == job.name and read.predicted is None


def test_a_text_job_s_records_name_seq_len_and_count_tokens_per_second_an_image_job_s_stay_as_they_were():
    from tests.conftest import default_job
    from tula_hpc.core.records import sequence_fields

    assert sequence_fields(default_job(), 100.0) == {} == sequence_fields(default_job())
    text = default_job().updated(data={"seq_len": 64})  # past validation: only the record's arithmetic matters here
    assert sequence_fields(text, 100.0) == {"seq_len": 64, "tokens_per_s": 6400.0}
    assert sequence_fields(text) == {"seq_len": 64}


def test_a_summary_s_epoch_history_holds_the_epochs_records_alone():
    """Between epochs' ends the history holds records of a kind (a validation, a batch schedule's decision mid-epoch);
    the epochs' own records, which alone carry an epoch's time, are the rest."""
    history = [
        {"kind": "validation", "step": 5, "epoch": 0, "val_loss": 3.0},
        {"kind": "batch_schedule", "step": 6, "epoch": 0, "batch_schedule": {}},
        {"epoch": 1, "step": 10, "epoch_time_s": 1.0},
        {"kind": "batch_schedule", "step": 12, "epoch": 1, "batch_schedule": {}},
        {"epoch": 2, "step": 14, "epoch_time_s": 0.5},
    ]
    times = {"train_time_s": 1.5, "train_time_with_lost_work_s": 1.5, "wall_time_s": 2.0}
    run = {"nodes": 1, "global_batch": 8, "per_device_batch": 8, "world_size": 1, "accumulation": 1, "micro_batch": 8}
    progress = {"epochs": 2, "steps": 14, "steps_per_epoch": 7, "strategy": "lbt", "train_samples": 56}
    restarts = {"resumed_from_epoch": None, "resumed_from_step": None, "restarts_at_steps": []}
    summary = TrainSummary(**run, **progress, **times, **restarts, history=history)
    assert [r["step"] for r in summary.epoch_history] == [10, 14]
