"""Optimisers: LARS against its formula, and which optimiser each recipe builds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import default_job
from tula_hpc.training.optimizers import LARS, build_optimizer


def test_lars_step_follows_the_formula():
    lr, momentum, decay, trust = 0.5, 0.9, 0.1, 0.02
    w = torch.tensor([[3.0, 4.0]])  # |w| = 5
    bias = torch.tensor([1.0])
    zero = torch.zeros(2, 2)
    opt = LARS(
        [{"params": [w, zero]}, {"params": [bias], "adapt": False}],
        lr=lr,
        momentum=momentum,
        weight_decay=decay,
        trust_coefficient=trust,
        eps=0.0,
    )
    g = torch.tensor([[0.6, 0.8]])  # |g| = 1

    def local_rate(weights):
        norm = float(weights.norm())
        return trust * norm / (1.0 + decay * norm)

    w.grad, bias.grad, zero.grad = g.clone(), torch.tensor([2.0]), torch.ones(2, 2)
    first = local_rate(w) * (g + decay * w)
    opt.step()
    torch.testing.assert_close(w, torch.tensor([[3.0, 4.0]]) - lr * first)
    torch.testing.assert_close(bias, torch.tensor([1.0 - lr * (2.0 + decay * 1.0)]))  # excluded: plain SGD
    torch.testing.assert_close(zero, torch.full((2, 2), -lr))  # |w| = 0: local rate 1

    w_before = w.clone()
    second = local_rate(w_before) * (g + decay * w_before)
    w.grad = g.clone()
    opt.step()
    torch.testing.assert_close(w, w_before - lr * (momentum * first + second))


@pytest.mark.parametrize(
    "strategy,ags_base,optimizer", [("lbt", "sgd", torch.optim.SGD), ("lars", "sgd", LARS), ("ags", "lars", LARS)]
)
def test_the_recipe_chooses_the_optimiser_and_lars_adapts_weight_tensors_only(strategy, ags_base, optimizer):
    train_cfg = default_job(train={"strategy": strategy, "momentum": 0.8, "ags": {"base": ags_base}}).train
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    built = build_optimizer(model, train_cfg, lr=0.3)
    assert type(built) is optimizer
    assert all(group["lr"] == 0.3 and group["momentum"] == 0.8 for group in built.param_groups)
    if optimizer is LARS:
        weights, others = built.param_groups
        assert [p.ndim for p in weights["params"]] == [2] and weights["adapt"]
        assert [p.ndim for p in others["params"]] == [1, 1, 1] and not others["adapt"]
