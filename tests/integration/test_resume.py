"""Resuming training after a kill: the checkpoint, not the log, decides what was done."""

from __future__ import annotations

import json

import pytest
import yaml

import tula_hpc.training.trainer as train_module
from tests.conftest import tiny_job_config
from tula_hpc.config import job_settings, load_config
from tula_hpc.training.trainer import train_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_kill_between_checkpoint_and_log_line_loses_no_epoch(tmp_path, monkeypatch):
    config = tiny_job_config()
    config["jobs"]["digits-cnn"]["train"].update(epochs=3, lr_milestones=[])
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    job = job_settings(load_config([tmp_path / "jobs.yaml"]), "digits-cnn")
    paths = [str(tmp_path / name) for name in ("checkpoint.pt", "model.pt", "metrics.jsonl")]
    append, lines = train_module.append_jsonl, []

    def killed_after_the_second_checkpoint(path, record):
        if len(lines) == 1:
            raise SystemExit("preempted")
        lines.append(record)
        append(path, record)

    monkeypatch.setattr(train_module, "append_jsonl", killed_after_the_second_checkpoint)
    with pytest.raises(SystemExit):
        train_worker(job, 128, *paths)
    monkeypatch.undo()

    summary = train_worker(job, 128, *paths)

    assert summary["restarts_at_steps"] == [2 * summary["steps_per_epoch"]]
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
