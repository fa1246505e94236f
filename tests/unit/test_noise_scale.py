"""The gradient noise scale's two-batch estimators and their smoothing on synthetic gradients of known mean and
covariance (the DDP comm hook itself runs in tests/integration/test_noise_scale_ddp.py)."""

import numpy as np
import pytest
import torch

from tula_hpc.training.noise_scale import AdamPreconditioner, NoiseScale, NoiseScaleHook, describe, two_batch_estimates


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


def _adam_with_known_v(v: torch.Tensor, steps: int = 3, eps: float = 1e-8) -> tuple[torch.Tensor, torch.optim.AdamW]:
    """A parameter and an AdamW whose state holds `v` (already bias-corrected at `steps` steps' correction)."""
    param = torch.nn.Parameter(torch.zeros(v.shape))
    optimizer = torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.99), eps=eps)
    correction = 1 - 0.99**steps
    optimizer.state[param] = {
        "step": torch.tensor(float(steps)),
        "exp_avg": torch.zeros_like(param),
        "exp_avg_sq": v * correction,
    }
    return param, optimizer


def test_the_preconditioned_noise_scale_is_tr_p_sigma_p_over_p_g_squared():
    """Per-sample gradients of mean G and diagonal covariance, preconditioned by Adam's 1 / (sqrt(v_hat) + eps) with a
    known v: the two-batch estimates on |P g|^2 recover tr(P Sigma P) / |P G|^2 (here a tenth of the plain noise scale:
    the preconditioner damps the noisy coordinates), within 10 %."""
    rng = np.random.default_rng(1)
    dims, ranks, local_batch = 50, 4, 8
    first_half = np.arange(dims) < dims // 2
    mean = rng.normal(size=dims) * 0.2
    std = rng.uniform(0.5, 1.5, size=dims) * np.where(first_half, 2.0, 0.5)  # the noise in the first half
    v = torch.tensor(np.where(first_half, 100.0, 0.01), dtype=torch.float32)  # which the preconditioner damps
    param, optimizer = _adam_with_known_v(v)
    (denominator,) = AdamPreconditioner(optimizer).denominators([param])
    assert torch.allclose(denominator, v.sqrt() + 1e-8)
    p = 1 / denominator.numpy()
    truth = float(np.sum((p * std) ** 2) / np.sum((p * mean) ** 2))
    plain = float(np.sum(std**2) / (mean @ mean))
    assert truth < plain / 3
    estimate = NoiseScale(0.999)
    for _ in range(2000):
        local = (mean + std * rng.standard_normal((ranks, local_batch, dims))).mean(axis=1) * p
        big = local.mean(axis=0)
        estimate.update(float(np.mean(np.sum(local**2, axis=1))), float(big @ big), local_batch, ranks * local_batch)
    assert estimate.value()["b_noise"] == pytest.approx(truth, rel=0.10)


class _Bucket:
    """DDP's GradBucket as the hook reads it: one flat buffer, the parameters and their gradients as its views."""

    def __init__(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        self._params, self._flat = params, flat

    def buffer(self) -> torch.Tensor:
        return self._flat

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return list(self._flat.split([p.numel() for p in self._params]))


def test_the_hook_measures_the_preconditioned_norms_skips_steps_without_v_and_counts_tokens(one_rank_group):
    """Before and after the all-reduce (here of one rank: the buffer divided by the 2 ranks the hook counts) the
    bucket's norms are |P g|^2 and |P g / 2|^2; a step before Adam has a v adds nothing; the record has B_noise in
    tokens and names its preconditioner. SGD's (no preconditioner) is the buffer's plain norm."""
    v = torch.tensor([4.0, 0.25, 1.0, 1.0])
    param, optimizer = _adam_with_known_v(v, eps=0.0)
    gradient = torch.tensor([2.0, 1.0, -3.0, 0.5])
    hook = NoiseScaleHook(2, preconditioner=AdamPreconditioner(optimizer), tokens_per_sample=64)
    hook.on_bucket(_Bucket([param], gradient.clone())).wait()
    preconditioned_sq = float(((gradient / v.sqrt()) ** 2).sum())  # 1 + 4 + 9 + 0.25
    assert (float(hook._small), float(hook._big)) == pytest.approx((preconditioned_sq, preconditioned_sq / 4))
    hook.end_step(8)
    assert hook.estimate.steps == 1
    record = hook.read()  # one rank: no true second batch, so no positive |G|^2 and no B_noise, in either unit
    assert (record["b_noise"], record["b_noise_tokens"], record["preconditioner"]) == (None, None, "adam")
    assert describe(2.0, 64.0, 5, tokens_per_sample=64)["b_noise_tokens"] == 32 * 64

    optimizer.state[param]["step"] = torch.tensor(0.0)  # moments reset (or no step yet): no v to divide by
    hook.on_bucket(_Bucket([param], gradient.clone())).wait()
    hook.end_step(8)
    assert hook.estimate.steps == 1 and float(hook._small) == 0.0

    sgd = NoiseScaleHook(2)
    sgd.on_bucket(_Bucket([param], gradient.clone())).wait()
    assert float(sgd._small) == float(torch.linalg.vector_norm(gradient, dtype=torch.float32).double().square())
    sgd.end_step(8)
    assert set(sgd.read()) == {"b_noise", "gradient_sq", "trace_sigma", "steps"}
