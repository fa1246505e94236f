"""Stage evaluate: the measured run priced as predicted; its worker launched by name, so the stage imports no torch."""

import pickle
import subprocess
import sys

import pytest

from tests.conftest import default_job
from tula_hpc.core.records import TrainSummary
from tula_hpc.stages.evaluate import EVALUATE_WORKER, measured_costs
from tula_hpc.training.evaluation import evaluate_worker


def test_measured_cost_is_priced_as_the_prediction_and_lost_work_apart():
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    run = {
        "nodes": 2,
        "global_batch": 200,
        "per_device_batch": 100,
        "world_size": 2,
        "accumulation": 1,
        "micro_batch": 100,
    }
    progress = {"epochs": 3, "steps": 30, "steps_per_epoch": 10, "strategy": "ags", "train_samples": 2000}
    times = {"train_time_s": 3600.0, "train_time_with_lost_work_s": 5400.0, "wall_time_s": 5500.0}
    restarts = {"resumed_from_epoch": 1, "resumed_from_step": 10, "restarts_at_steps": [10], "history": []}
    summary = TrainSummary(**run, **progress, **times, **restarts)
    for pricing, per_hour in (("node_hour", 2 * 2.48), ("memory", 2 * 3.0 * 0.15)):
        job = default_job(objective={"pricing": pricing})
        assert measured_costs(job, summary, memory) == pytest.approx(
            {"measured_cost": per_hour, "measured_cost_with_lost_work": 1.5 * per_hour}
        )


@pytest.mark.spawns
def test_the_worker_is_launched_by_name_and_a_job_pickled_before_the_move_still_finds_it():
    assert EVALUATE_WORKER.module == evaluate_worker.__module__ and EVALUATE_WORKER.function == "evaluate_worker"
    for old in ("tula_hpc.stages.evaluate", "tula_hpc.evaluate"):  # before the worker moved; before the folders
        assert pickle.loads(f"c{old}\nevaluate_worker\n.".encode()) is evaluate_worker
    check = "import sys, tula_hpc.stages.evaluate; print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout.split()
    assert "torch" not in loaded and "tula_hpc.stages.evaluate" in loaded
