"""train.batch_schedule adaptive inside the real DAG: the train rule reads perfmodel.json, every epoch's end records
its choice, the report shows the schedule, and a rerun has nothing to do."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.conftest import snakemake_command, tiny_job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_dag_trains_on_an_adaptive_batch_schedule(tmp_path):
    config = tiny_job_config()
    job = config["jobs"]["digits-cnn"]
    job["train"].update(batch_schedule="adaptive", strategy="adascale", epochs=4, lr_milestones=[3])
    job["search"].update(warmup_steps=1, steps=2, min_measure_s=0.1, max_attempts=1, confirm=0)
    job["objective"] = {"minimize": "goodput"}
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    command = snakemake_command(tmp_path, "local", tmp_path / "jobs.yaml")
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    results = tmp_path / "results" / "digits-cnn"
    summary = json.loads((results / "train" / "summary.json").read_text())
    chosen = json.loads((results / "selection.json").read_text())["chosen"]
    candidates = json.loads((results / "perfmodel.json").read_text())["candidates"]
    at_the_shape = {c["batch"] for c in candidates if c["nodes"] == chosen["nodes"]}
    schedule = [epoch["batch_schedule"] for epoch in summary["history"]]
    assert summary["batch_schedule"] == "adaptive" and schedule[0]["ran"]["global_batch"] == chosen["batch"]
    assert {s["next"]["global_batch"] for s in schedule} <= at_the_shape
    if summary["world_size"] > 1:  # the noise scale is measured between ranks: the choice follows it
        assert all(s["reason"] == "goodput" and s["b_noise"] > 0 for s in schedule)
    else:
        assert all(s["reason"] == "no noise scale measured" for s in schedule)
    assert "Batch schedule `adaptive`" in (results / "report.md").read_text()
    dry = subprocess.run([*command, "-n"], capture_output=True, text=True)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr
