"""prediction.py: T and cost of every candidate (Eq. 4) from a fitted model and the measured steps."""

import dataclasses
import math

import pytest

from tests.conftest import default_job
from tests.unit.test_performance import fit, synthetic
from tula_hpc.core.errors import StageError
from tula_hpc.core.job import Job
from tula_hpc.core.run_layout import steps_per_epoch
from tula_hpc.performance.fitting import estimate_steps
from tula_hpc.performance.prediction import predict_candidates
from tula_hpc.performance.run_overhead import fit_overheads


def _job(**objective) -> Job:
    """The default job on Slurm partition gpu, 3 epochs at 3.6 per node-hour, `objective` changed."""
    return default_job(
        train={"epochs": 3, "lr_milestones": []},
        resources={"slurm": {"partition": "gpu"}},
        objective={"price_per_node_hour": 3.6, **objective},
    )


def test_total_time_and_cost_follow_eq_4_under_every_pricing():
    model = fit(synthetic([1, 1, 2, 2], [10, 40, 10, 40]))
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    job = _job(pricing="memory", price_per_gb_hour=0.5, charge_factors={"gpu": 4.0})
    [row] = predict_candidates(
        model, [{"nodes": 2, "batch": 40, "per_device_batch": 20}], job, train_samples=1000, memory=memory
    )
    assert row["steps_per_epoch"] == steps_per_epoch(1000, 2, 20) == 25
    assert row["time_s"] == pytest.approx(3 * 25 * model.predict([[2, 20, 2]])[0])
    # 1000 samples over 2 ranks in batches of 30: 16 full steps and a last one of 20 per rank.
    [odd] = predict_candidates(model, [{"nodes": 2, "batch": 60, "per_device_batch": 30}], job, 1000, memory)
    assert odd["time_s"] == pytest.approx(3 * (16 * model.predict([[2, 30, 2]])[0] + model.predict([[2, 20, 2]])[0]))
    hours = row["time_s"] / 3600
    assert row["costs"]["node_hour"] == pytest.approx(hours * 2 * 3.6)
    assert row["costs"]["memory"] == pytest.approx(hours * 2 * (1 + 1 + 0.2) * 0.5)  # 2 devices x 2.2 GB
    assert row["costs"]["service_units"] == pytest.approx(hours * 2 * 4.0)
    assert row["cost"] == row["costs"]["memory"]


def test_a_profiled_candidate_moves_toward_its_measurement_and_an_unprofiled_one_keeps_the_model():
    model = fit(synthetic([1, 1, 2, 2], [10, 40, 10, 40]))
    X = [[2, 20, 2], [1, 10, 1]]
    predicted = model.predict(X)
    measured = {(2, 20, 2): predicted[0] * 1.4}  # keyed by the whole model row
    steps = estimate_steps(model, X, measured, weight=0.75)
    assert steps[0] == pytest.approx(predicted[0] * (1 + 0.75 * 0.4))
    assert steps[1] == predicted[1]
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    job = _job()
    # 1000 samples over 2 ranks in batches of 20 per rank: 25 steps, the last one full too.
    [row] = predict_candidates(
        model, [{"nodes": 2, "batch": 40, "per_device_batch": 20}], job, 1000, memory, measured, 0.75
    )
    assert row["step_s"] == pytest.approx(steps[0]) and row["model_step_s"] == pytest.approx(predicted[0])
    assert row["time_s"] == pytest.approx(3 * 25 * steps[0])


def test_service_units_without_a_factor_for_the_partition_is_a_clear_error():
    model = fit(synthetic([1, 1], [10, 40]))
    job = _job(pricing="service_units")
    # no default either: replaced, not merged into the jobs file's factors
    job = dataclasses.replace(job, objective=dataclasses.replace(job.objective, charge_factors={"cpu": 1.0}))
    with pytest.raises(
        StageError, match="job 'digits-cnn': field 'objective.charge_factors': no factor for partition 'gpu'"
    ):
        predict_candidates(model, [{"nodes": 1, "batch": 10, "per_device_batch": 10}], job, 1000, memory={})


def test_node_shapes_with_the_same_ranks_and_batch_are_predicted_and_measured_apart():
    """2 nodes x 2 GPUs and 4 nodes x 1 GPU: 4 ranks at 16 per device both, but 2 and 1 ranks per host."""
    from tula_hpc.performance.fitting import measured_steps

    model = fit(synthetic([1, 1, 4, 4], [10, 40, 16, 40], per_host=[1, 1, 2, 2]))
    shapes = [{"nodes": n, "gpus_per_node": g, "batch": 64, "per_device_batch": 16} for n, g in ((2, 2), (4, 1))]
    profile = {"world_size": 4, "per_device_batch": 16, "ranks_per_host": 2, "median": {"step_s": 1.0}}
    assert measured_steps([profile]) == {(4, 16, 2): 1.0}
    job = dataclasses.replace(_job(), launcher="slurm")
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    rows = predict_candidates(model, shapes, job, 1000, memory, measured_steps([profile]), 0.5)
    assert [(r["ranks"], r["ranks_per_host"], r["profiled"]) for r in rows] == [(4, 2, True), (4, 1, False)]
    assert rows[0]["step_s"] == pytest.approx((rows[0]["model_step_s"] + 1.0) / 2)
    assert rows[1]["step_s"] == rows[1]["model_step_s"] != rows[0]["model_step_s"]


def test_time_to_the_recipes_progress_counts_the_steps_the_batch_needs():
    from tula_hpc.performance.prediction import to_progress
    from tula_hpc.training.progress import steps_to_progress

    job = default_job(train={"epochs": 10, "lr_base_batch": 100, "lr_milestones": []})
    row = {"batch": 400, "step_s": 0.5, "steps_per_epoch": 25, "time_s": 125.0, "cost": 2.0}
    row.update(warmup_s=3.0, epoch_start_s=0.25)
    to_progress([row], job, train_samples=10_000, b_noise=200.0)
    steps = steps_to_progress(10 * 100, 200.0, 100, 400)  # the recipe: 10 epochs of 100 steps at batch 100
    assert row["progress_steps"] == pytest.approx(steps) and row["progress_epochs"] == pytest.approx(steps / 25)
    # the warm-up once, and an epoch start for each epoch the steps run into after the first
    time_s = steps * 0.5 + 3.0 + (math.ceil(steps / 25) - 1) * 0.25
    assert row["progress_time_s"] == pytest.approx(time_s)
    assert row["progress_cost"] == pytest.approx(2.0 * time_s / 125.0)


def test_warm_up_and_epoch_ends_add_to_the_steps_as_training_counts_its_epochs():
    """T = W_1 + W_2 + E x steps of an epoch + (E - 1) x c_epoch; the job's time adds E x the work outside."""
    model = fit(synthetic([1, 1, 2, 2], [10, 40, 10, 40]))
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    profiles = [
        {
            "world_size": 2,
            "per_device_batch": 20,
            "ranks_per_host": 2,
            "median": {"step_s": 0.1},
            "warmup_step_s": [1.1, 0.2, 0.1],  # 1.1 s over three steady steps
            "epoch_ends": {
                "last_step_s": [0.5, 0.1],
                "strategy_end_s": [0.02, 0.01],
                "start_s": [0.9, 0.3],
                "validation_s": [0.6, 0.4],
                "checkpoint_s": 0.05,
            },
        }
    ]
    overheads = fit_overheads(profiles)
    [row] = predict_candidates(
        model, [{"nodes": 2, "batch": 40, "per_device_batch": 20}], _job(), 1000, memory, overheads=overheads
    )
    steps_epoch = 25 * model.predict([[2, 20, 2]])[0]
    assert row["warmup_first_s"] == pytest.approx(1.1 + 0.4) and row["warmup_second_s"] == pytest.approx(0.6)
    assert row["epoch_start_s"] == pytest.approx(0.2) and row["outside_epoch_s"] == pytest.approx(0.46)
    assert row["epoch_s"] == pytest.approx(steps_epoch + 0.2)
    assert row["first_epoch_s"] == pytest.approx(steps_epoch + 1.5)
    assert row["time_s"] == pytest.approx(1.5 + 0.6 + 3 * steps_epoch + 2 * 0.2)
    assert row["job_time_s"] == pytest.approx(row["time_s"] + 3 * 0.46)


def test_no_step_is_shorter_than_the_loaders_workers_take_to_make_its_batch():
    """A loader slower than the step sets an epoch's pace (loader_rate.py); a faster one changes nothing."""
    from tula_hpc.performance.loader_rate import LoaderRate

    model = fit(synthetic([1, 1, 2, 2], [10, 40, 10, 40]))
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    candidate = {"nodes": 2, "batch": 40, "per_device_batch": 20}
    [free] = predict_candidates(model, [candidate], _job(), 1000, memory)
    slow = LoaderRate(workers=2).fit([20], [2 * free["step_s"]])  # a batch every 2 steps' time
    [bound] = predict_candidates(model, [candidate], _job(), 1000, memory, loader=slow)
    assert bound["loader_bound"] and not free["loader_bound"]
    assert bound["step_s"] == pytest.approx(2 * free["step_s"]) and bound["model_step_s"] == free["model_step_s"]
    assert bound["time_s"] == pytest.approx(2 * free["time_s"])  # 25 full steps an epoch, the last one too
    fast = LoaderRate(workers=2).fit([20], [free["step_s"] / 2])
    [kept] = predict_candidates(model, [candidate], _job(), 1000, memory, loader=fast)
    assert not kept["loader_bound"] and kept["time_s"] == pytest.approx(free["time_s"])
    assert kept["loader_s"] == pytest.approx(free["step_s"] / 2)


def test_an_epochs_last_step_below_the_smallest_profiled_batch_keeps_the_epoch_finite():
    # Profiled at 32 and 512 per device, compute convex: 968 samples over 2 ranks in batches of 32 leave a last step
    # of 4 per rank, where the line through the profiles has crossed zero (it made epoch_s, time_s and cost NaN).
    model = fit(synthetic([1, 1, 2, 2], [32, 512, 32, 512], curvature=2e-6))
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    [row] = predict_candidates(model, [{"nodes": 2, "batch": 64, "per_device_batch": 32}], _job(), 968, memory)
    full, last = model.predict([[2, 32, 2], [2, 4, 2]])
    assert row["epoch_s"] == pytest.approx(15 * full + last)
    assert all(math.isfinite(row[key]) for key in ("epoch_s", "time_s", "cost")) and 0 < last < full
