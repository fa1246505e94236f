import numpy as np
import pytest

from tula_hpc.perfmodel import PerfModel, predict_candidates, steps_per_epoch

GRAD_BYTES = 4e7


def synthetic(ranks, batch, a0=2e-3, a1=3e-4, latency=1e-4, per_byte=2e-9, overlap=0.25, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    ranks, batch = np.asarray(ranks, float), np.asarray(batch, float)
    local = a0 + a1 * batch
    sync = 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * GRAD_BYTES * per_byte
    jitter = lambda x: x * (1 + noise * rng.standard_normal(x.shape))  # noqa: E731
    return jitter(local + (1 - overlap) * sync), jitter(local), jitter(sync)


def test_fit_recovers_known_coefficients_from_noisy_timings():
    ranks, batch = np.meshgrid([1, 2, 4, 8, 16], [8, 16, 32, 64, 128, 256])
    ranks, batch = ranks.ravel(), batch.ravel()
    step, local, sync = synthetic(ranks, batch, noise=0.02)
    model = PerfModel(grad_bytes=GRAD_BYTES).fit(np.column_stack([ranks, batch]), step, local_s=local, sync_s=sync)
    assert model.local_intercept_s_ == pytest.approx(2e-3, rel=0.15)
    assert model.local_per_sample_s_ == pytest.approx(3e-4, rel=0.05)
    assert model.seconds_per_byte_ == pytest.approx(2e-9, rel=0.1)
    assert model.overlap_ == pytest.approx(0.25, abs=0.05)
    true_step, _, _ = synthetic([32], [512])
    assert model.predict([[32, 512]])[0] == pytest.approx(true_step[0], rel=0.05)


def test_partial_extremes_predict_the_unprofiled_middle_without_noise():
    ranks, batch = np.array([1, 1, 4, 4]), np.array([32, 256, 8, 64])
    step, local, sync = synthetic(ranks, batch)
    model = PerfModel(grad_bytes=GRAD_BYTES).fit(np.column_stack([ranks, batch]), step, local_s=local, sync_s=sync)
    expected, _, _ = synthetic([4], [32])
    assert model.predict([[4, 32]])[0] == pytest.approx(expected[0], rel=1e-3)


def test_coefficients_are_never_negative():
    X = np.array([[1, 8], [1, 64], [2, 8], [2, 64]])
    y = np.array([0.05, 0.01, 0.05, 0.01])  # time falling with batch: a negative slope would fit better
    model = PerfModel(grad_bytes=1e6).fit(X, y, local_s=y, sync_s=[0, 0, 0.001, 0.001])
    assert min(model.local_per_sample_s_, model.local_intercept_s_, model.latency_s_, model.seconds_per_byte_) >= 0


def test_total_time_and_cost_follow_eq_4():
    model = PerfModel(grad_bytes=0).fit([[1, 10], [1, 20]], [0.1, 0.2])
    [row] = predict_candidates(model, [{"nodes": 2, "batch": 40, "per_device_batch": 20}], devices_per_node=1,
                               train_samples=1000, epochs=3, price_per_node_hour=3.6)
    assert row["steps_per_epoch"] == steps_per_epoch(1000, 2, 20) == 25
    assert row["time_s"] == pytest.approx(3 * 25 * 0.2)
    assert row["cost"] == pytest.approx(row["time_s"] / 3600 * 2 * 3.6)
