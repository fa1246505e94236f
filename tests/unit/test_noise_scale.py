"""The gradient noise scale's two-batch estimators and their smoothing on synthetic gradients of known mean and
covariance (the DDP comm hook itself runs in tests/integration/test_noise_scale_ddp.py)."""

import numpy as np
import pytest
import torch

from tula_hpc.training.noise_scale import NoiseScale, NoiseScaleHook, describe, two_batch_estimates


def test_expected_squared_norms_give_the_exact_gradient_and_trace():
    """E|g_B|^2 = |G|^2 + tr(Sigma) / B: at the expectations the estimators are exact."""
    gradient_sq, trace = 4.0, 256.0
    small, big = gradient_sq + trace / 8, gradient_sq + trace / 64
    assert two_batch_estimates(small, big, 8, 64) == pytest.approx((gradient_sq, trace))
    with pytest.raises(ValueError, match="small batch < big batch"):
        two_batch_estimates(small, big, 64, 64)


def _simulate(steps: int, ranks: int, local_batch: int, seed: int = 0, smoothing: float = 0.99):
    """Per-sample gradients of mean G and diagonal covariance; each step's rank gradients and their mean."""
    rng = np.random.default_rng(seed)
    dims = 50
    mean = rng.normal(size=dims) * 0.2
    std = rng.uniform(0.5, 1.5, size=dims)
    estimate = NoiseScale(smoothing)
    for _ in range(steps):
        samples = mean + std * rng.standard_normal((ranks, local_batch, dims))
        local = samples.mean(axis=1)
        big = local.mean(axis=0)
        small_sq = float(np.mean(np.sum(local**2, axis=1)))  # the ranks' average, as `read` combines them
        estimate.update(small_sq, float(big @ big), local_batch, ranks * local_batch)
    return estimate, float(np.sum(std**2) / (mean @ mean))


def test_smoothed_estimates_recover_the_noise_scale():
    """B_noise = tr(Sigma) / |G|^2 of the synthetic gradients (here about 25), from 4 ranks of 8 samples, far below
    it: the regime where large batches stop paying. Within 10 % after 2000 steps at 0.999 (the moving averages'
    relative standard error is about 5 % here, from repeated seeds)."""
    errors = []
    for seed in range(5):
        estimate, truth = _simulate(2000, 4, 8, seed=seed, smoothing=0.999)
        errors.append(estimate.value()["b_noise"] / truth - 1)
    assert max(abs(e) for e in errors) < 0.10
    assert abs(np.mean(errors)) < 0.05  # no bias beyond the spread


def test_the_first_steps_are_not_pulled_toward_zero_and_state_round_trips():
    estimate = NoiseScale(0.99)
    assert estimate.value() is None
    estimate.update(4.0 + 256.0 / 8, 4.0 + 256.0 / 64, 8, 64)
    value = estimate.value()
    assert (value["gradient_sq"], value["trace_sigma"], value["b_noise"]) == pytest.approx((4.0, 256.0, 64.0))
    again = NoiseScale(0.99)
    again.load_state_dict(estimate.state_dict())
    assert again.value() == estimate.value()
    assert describe(-1.0, 5.0, 3)["b_noise"] is None  # |G|^2 not yet positive: no noise scale


def test_the_hook_needs_two_ranks_and_adds_nothing_for_a_step_that_did_not_sync():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        NoiseScaleHook(1)
    hook = NoiseScaleHook(2)
    hook.end_step(8)
    assert hook.estimate.steps == 0
    assert torch.is_tensor(hook.estimate.gradient_sq)
