"""The real DAG on a job whose loader cannot keep up with its steps: a user's data set behind a slow file system
(bench/tula_bench/slow_storage.py), two loader workers. Every profile times the loader, fit-model holds the steps to
its pace, and the report says the loader sets it."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.conftest import REPO, job_config
from tests.integration.test_dag import snakemake

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LATENCY_MS = 2.0  # an image: 64 ms a batch of 32 in one worker, a step of a few ms here
WORKERS = 2


def test_a_loader_slower_than_the_step_sets_the_predicted_and_the_measured_pace(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO / "bench"), os.environ.get("PYTHONPATH")])))
    data = {
        "name": "tula_bench.slow_storage:digits_behind_latency",
        "kwargs": {"latency_ms": LATENCY_MS},
        "num_workers": WORKERS,
    }
    search = {"nodes": {"min": 1, "max": 1}, "batch": {"min": 32, "max": 64}, "warmup_steps": 2, "steps": 4}
    config = job_config(data=data, search=search, train={"epochs": 2, "lr_milestones": []})
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = tmp_path / "results" / "digits-cnn"
    for path in (results / "profile").glob("*.json"):
        profile = json.loads(path.read_text())
        least = profile["per_device_batch"] * LATENCY_MS / 1000 / WORKERS  # the workers' pace at best
        assert profile["loader"]["workers"] == WORKERS and profile["loader"]["period_s"] >= least
        assert profile["median"]["step_s"] < profile["loader"]["period_s"]  # its steps drew on batches made ahead
    perfmodel = json.loads((results / "perfmodel.json").read_text())
    assert perfmodel["loader_rate"]["workers"] == WORKERS and perfmodel["loader_rate"]["per_sample_s"] > 0
    chosen = json.loads((results / "selection.json").read_text())["chosen"]
    assert chosen["loader_bound"] and chosen["step_s"] == pytest.approx(chosen["loader_s"])
    assert "the loader sets the pace" in (results / "report.md").read_text()
    evaluation = json.loads((results / "eval.json").read_text())
    # The steps alone would predict a tenth of the time: the pace must be in the prediction (not a speed target).
    assert evaluation["predicted_train_time_s"] > 0.3 * evaluation["measured_train_time_s"]
