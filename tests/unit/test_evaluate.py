import torch
from torch import nn
from torch.utils.data import TensorDataset

from tula_hpc.evaluate import recompute_batchnorm_statistics


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
