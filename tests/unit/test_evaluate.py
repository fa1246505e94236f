"""Stage evaluate: BatchNorm statistics recomputed on the training set, the measured run priced as predicted."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.conftest import default_job
from tula_hpc.evaluate import measured_costs, recompute_batchnorm_statistics


def test_precise_bn_replaces_stale_running_statistics_with_the_training_set_average():
    torch.manual_seed(0)
    x = torch.randn(1000, 3) * torch.tensor([1.0, 2.0, 0.5]) + torch.tensor([5.0, -3.0, 0.25])
    data = TensorDataset(x, torch.zeros(1000, dtype=torch.long))
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=0.01))
    model[0].running_mean.fill_(100.0)  # what a few steps at momentum 0.01 leave: close to the start, far from the data
    assert recompute_batchnorm_statistics(model, data, torch.device("cpu"), batch_size=100)
    assert torch.allclose(model[0].running_mean, x.mean(0), atol=1e-4)
    # Averaged per batch of 100: the unbiased variance within each batch, not over the whole set.
    per_batch = torch.stack([chunk.var(0) for chunk in x.split(100)]).mean(0)
    assert torch.allclose(model[0].running_var, per_batch, rtol=1e-4)
    assert model[0].momentum == 0.01 and model.training  # the model is left as training left it, statistics aside


def test_a_model_without_batchnorm_is_left_alone():
    model = nn.Linear(3, 2)
    before = [p.clone() for p in model.parameters()]
    assert not recompute_batchnorm_statistics(model, TensorDataset(torch.randn(10, 3)), torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_measured_cost_is_priced_as_the_prediction_and_lost_work_apart():
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}
    summary = {
        "nodes": 2,
        "world_size": 2,
        "per_device_batch": 100,
        "train_time_s": 3600.0,
        "train_time_with_lost_work_s": 5400.0,
    }
    for pricing, per_hour in (("node_hour", 2 * 2.48), ("memory", 2 * 3.0 * 0.15)):
        job = default_job(objective={"pricing": pricing})
        assert measured_costs(job, summary, memory) == pytest.approx(
            {"measured_cost": per_hour, "measured_cost_with_lost_work": 1.5 * per_hour}
        )
