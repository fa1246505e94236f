"""Optimisers: LARS against its formula, which optimiser each recipe builds, AdamW's decay groups, and clipping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.conftest import default_job
from tula_hpc.training.gpt import gpt
from tula_hpc.training.optimizers import (
    LAMB,
    LARS,
    PARAMETER_KINDS,
    build_optimizer,
    clip_gradients,
    decay_groups,
    parameter_kinds,
    reset_moments,
)


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


class TiedLM(nn.Module):
    """An embedding, a norm, a linear layer with a bias, and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.hidden = nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight


def test_adamw_decays_the_weight_matrices_only_and_takes_betas_and_eps():
    train_cfg = default_job(
        train={"optimizer": "adamw", "strategy": "lbt", "weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}
    ).train
    model = TiedLM()
    built = build_optimizer(model, train_cfg, lr=3e-4)
    assert type(built) is torch.optim.AdamW
    decayed, others = built.param_groups
    assert decayed["params"] == [model.hidden.weight] and decayed["weight_decay"] == 0.1
    assert others["params"] == [model.embed.weight, model.norm.weight, model.norm.bias, model.hidden.bias]
    assert others["weight_decay"] == 0.0
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["lr"] == 3e-4 for g in built.param_groups)


def test_adamw_defaults_to_gpt3s_betas_and_torchs_eps():
    train_cfg = default_job(train={"optimizer": "adamw", "strategy": "lbt"}).train
    built = build_optimizer(TiedLM(), train_cfg, lr=1e-3)
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in built.param_groups)


def test_a_tied_parameter_is_in_one_group_once():
    groups = decay_groups(TiedLM(), 0.1)
    listed = [id(p) for group in groups for p in group["params"]]
    assert len(listed) == len(set(listed)) == len(list(TiedLM().parameters()))


def test_parameter_kinds_of_the_gpt_name_embeddings_norms_biases_and_attention():
    model = gpt(vocab_size=11, seq_len=8, layers=1, heads=2, width=8)
    kinds = parameter_kinds(model)
    block = model.blocks[0]
    assert len(kinds) == len(list(model.parameters()))  # the head's tied weight once, as an embedding
    assert kinds[model.tokens.weight] == kinds[model.head.weight] == kinds[model.positions.weight] == "embeddings"
    assert {kinds[p] for p in [*block.norm_attention.parameters(), *model.norm.parameters()]} == {"norms"}
    assert kinds[block.attention.qkv.bias] == kinds[block.mlp[0].bias] == "biases"
    assert kinds[block.attention.qkv.weight] == kinds[block.attention.proj.weight] == "attention"
    assert kinds[block.mlp[0].weight] == kinds[block.mlp[2].weight] == "weights"
    assert set(kinds.values()) == set(PARAMETER_KINDS)


def test_parameter_kinds_know_torchs_attention_and_batch_norm():
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(4, 2), "bn": nn.BatchNorm1d(4)})
    kinds = parameter_kinds(model)
    assert kinds[model["mha"].in_proj_weight] == kinds[model["mha"].out_proj.weight] == "attention"
    assert kinds[model["mha"].in_proj_bias] == "biases"
    assert kinds[model["bn"].weight] == kinds[model["bn"].bias] == "norms"


def test_decay_groups_are_the_weight_kinds():
    model = gpt(vocab_size=11, seq_len=8, layers=1, heads=2, width=8)
    decayed, others = decay_groups(model, 0.1)
    kinds = parameter_kinds(model)
    assert decayed["params"] == [p for p in model.parameters() if p.ndim >= 2 and kinds[p] != "embeddings"]
    assert {kinds[p] for p in others["params"]} == {"embeddings", "norms", "biases"}


def test_clipping_scales_the_gradient_to_the_global_norm_and_none_leaves_it():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # global norm 5
    clip_gradients([a, b], None)
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [4.0]
    clip_gradients([a, b], 1.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.0, 0.8]), atol=1e-5, rtol=1e-5)
    clip_gradients([a, b], 10.0)  # below the limit: unchanged
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.0, 0.8]), atol=1e-5, rtol=1e-5)


def test_lamb_steps_by_the_trust_ratio_of_adams_update():
    """One step: m_hat / sqrt(v_hat) is sign(g) = (1, 1), u = (1, 1) + 0.1 w = (1.3, 1.4), w -= lr |w| / |u| u with
    |w| = 5; the second step from moments by hand; a zero weight keeps the ratio 1."""
    lr, decay, (beta1, beta2) = 0.5, 0.1, (0.9, 0.99)
    w, zero = torch.tensor([[3.0, 4.0]]), torch.zeros(2, 2)
    opt = LAMB([w, zero], lr=lr, betas=(beta1, beta2), eps=0.0, weight_decay=decay)
    g, g2 = torch.tensor([[0.6, 0.8]]), torch.tensor([[0.3, -0.4]])
    w.grad, zero.grad = g.clone(), torch.ones(2, 2)
    opt.step()
    update = torch.tensor([[1.3, 1.4]])
    after_one = torch.tensor([[3.0, 4.0]]) - lr * 5 / update.norm() * update
    torch.testing.assert_close(w, after_one)
    torch.testing.assert_close(zero, torch.full((2, 2), -lr))  # u = (1, ...), |w| = 0: ratio 1

    w.grad = g2.clone()
    opt.step()
    m_hat = (beta1 * (1 - beta1) * g + (1 - beta1) * g2) / (1 - beta1**2)
    v_hat = (beta2 * (1 - beta2) * g**2 + (1 - beta2) * g2**2) / (1 - beta2**2)
    update = m_hat / v_hat.sqrt() + decay * after_one
    torch.testing.assert_close(w, after_one - lr * after_one.norm() / update.norm() * update)


def test_lambs_unadapted_groups_step_as_adamw():
    """Biases, norms and embeddings (adapt=False) take torch's AdamW steps, decoupled decay included."""
    torch.manual_seed(0)
    start = torch.randn(3, 4)
    lamb_w, adamw_w = start.clone().requires_grad_(), start.clone().requires_grad_()
    settings = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    lamb = LAMB([{"params": [lamb_w], "adapt": False}], **settings)
    adamw = torch.optim.AdamW([adamw_w], **settings)
    for _ in range(3):
        grad = torch.randn(3, 4)
        lamb_w.grad, adamw_w.grad = grad.clone(), grad.clone()
        lamb.step()
        adamw.step()
        torch.testing.assert_close(lamb_w, adamw_w)


@pytest.mark.parametrize("strategy,ags_base", [("lars", "sgd"), ("ags", "lars")])
def test_the_lars_recipe_under_adamw_is_lamb_over_adamws_decay_groups(strategy, ags_base):
    train_cfg = default_job(train={"optimizer": "adamw", "strategy": "lbt", "weight_decay": 0.1}).train
    train_cfg = dataclasses.replace(train_cfg, strategy=strategy, ags=dataclasses.replace(train_cfg.ags, base=ags_base))
    model = TiedLM()
    built = build_optimizer(model, train_cfg, lr=1e-3)
    assert type(built) is LAMB
    weights, others = built.param_groups
    assert weights["params"] == [model.hidden.weight] and weights["adapt"] and weights["weight_decay"] == 0.1
    assert len(others["params"]) == 4 and not others["adapt"] and others["weight_decay"] == 0.0


def test_reset_moments_zeroes_adams_moments_and_step_and_keeps_the_weights():
    net = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    weights = [p.detach().clone() for p in net.parameters()]
    reset_moments(optimizer)
    for state in optimizer.state.values():
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert all(torch.equal(w, p) for w, p in zip(weights, net.parameters()))
