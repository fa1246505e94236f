"""Large-batch strategies: AGS's reference pass, the rate each recipe steps at, resumes at another batch, polo and
adascale on two ranks."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import REPO, default_job, run_on_two_ranks
from tula_hpc.config import ConfigError, load_config, validate_config
from tula_hpc.core.job import TrainSettings
from tula_hpc.training.ags import TulaOptimizer
from tula_hpc.training.gpt import gpt
from tula_hpc.training.noise_scale import NoiseScaleHook
from tula_hpc.training.optimizers import LARS, parameter_kinds
from tula_hpc.training.step import training_step
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import CausalLM, ImageClassification

IMAGES = ImageClassification()  # cross-entropy on a pair batch (inputs, classes)


class _Regression(ImageClassification):
    """Mean squared error on a pair batch (inputs, targets): a noisy regression for AdaScale's gain."""

    def loss(self, output, batch):
        return F.mse_loss(output, batch[1]), self.count(batch)


REGRESSION = _Regression()


def _lrs(strategy, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(strategy.optimizer.param_groups[0]["lr"])
        strategy.optimizer.step()
        strategy.after_step()
    return seen


def test_ags_reads_the_reference_gradient_off_the_training_step_as_a_separate_pass_would():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))  # no BatchNorm: micro-batches are exact
    separate = copy.deepcopy(model)
    train_cfg = default_job(train={"strategy": "ags"}).train
    fused, reference = (build_strategy(m, train_cfg, 128, steps_per_epoch=4) for m in (model, separate))
    for strategy in (fused, reference):
        strategy.end_epoch()  # an epoch-cadence update is due
    x, y = torch.randn(128, 6), torch.randint(0, 4, (128,))

    loss = training_step(model, fused, IMAGES, [x, y])
    F.cross_entropy(separate(x), y).backward()
    reference.optimizer.update_gradscale(separate, IMAGES.loss_of, [x, y])

    assert torch.allclose(loss, F.cross_entropy(separate(x), y))
    factors = [fused.optimizer.gradscale[p] for p in model.parameters()]
    expected = [reference.optimizer.gradscale[p] for p in separate.parameters()]
    assert all(torch.allclose(f, e, rtol=1e-4) for f, e in zip(factors, expected))
    assert any((f != 1).any() for f in factors)


def test_fp16_ags_separate_reference_pass_runs_at_the_step_precision_and_is_unscaled():
    """A batch of exactly B_small is its own reference: the factors of the same samples are 1, not clamped at s_max."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
    strategy = build_strategy(model, default_job(train={"strategy": "ags", "precision": "fp16"}).train, 128, 4)
    strategy.end_epoch()
    dtypes = []
    model[0].register_forward_hook(lambda module, inputs, out: dtypes.append(out.dtype))
    training_step(model, strategy, IMAGES, [torch.randn(32, 6), torch.arange(32) % 4])
    assert dtypes == [torch.float16, torch.float16]  # the step's forward, then the reference pass's
    factors = strategy.optimizer.gradscale
    assert strategy.optimizer.s_max == 2 and len(factors) == 4
    assert all(torch.allclose(f, torch.ones_like(f), atol=1e-2) for f in factors.values())


@pytest.mark.parametrize("base,optimizer", [("lrs", torch.optim.SGD), ("lars", LARS)])
def test_ags_on_another_recipe_scales_the_gradients_of_its_optimiser_rate_and_warm_up(base, optimizer):
    train = dict(strategy="ags", lr=0.05, lr_base_batch=128, warmup_epochs=2, lr_milestones=[3], lr_gamma=0.1)
    train["ags"] = {"base": base}
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    strategy = build_strategy(model, default_job(train=train).train, global_batch=512, steps_per_epoch=4)
    assert isinstance(strategy.optimizer, TulaOptimizer) and type(strategy.optimizer.optimizer) is optimizer
    peak = 0.05 * 512 / 128
    assert _lrs(strategy, 16) == pytest.approx([peak * (k + 1) / 8 for k in range(8)] + [peak] * 4 + [peak / 10] * 4)


@pytest.mark.parametrize(
    "optimizer, scaled",
    [("adamw", {"attention", "weights"}), ("sgd", {"embeddings", "norms", "biases", "attention", "weights"})],
)
def test_ags_trains_a_tiny_gpt_on_the_update_under_adamw_leaving_the_default_exclusions(optimizer, scaled):
    """End to end on one process: the strategy's factors cover the kinds train.ags.exclude's default scales."""
    torch.manual_seed(0)
    model = gpt(vocab_size=11, seq_len=8, layers=1, heads=2, width=8)
    ags = {"small_batch": 2, "update_every_steps": 1, "delta": 10.0}
    train_cfg = default_job(train={"optimizer": optimizer, "strategy": "ags", "lr": 1e-3, "ags": ags}).train
    strategy = build_strategy(model, train_cfg, global_batch=8, steps_per_epoch=3)
    assert strategy.optimizer.target == ("update" if optimizer == "adamw" else "gradient")
    task, shape = CausalLM(), {"vocab_size": 11, "seq_len": 8}
    losses = [training_step(model, strategy, task, task.example_batch(shape, 8, "cpu")).item() for _ in range(3)]
    kinds = parameter_kinds(model)
    assert {kinds[p] for p in strategy.optimizer.gradscale} == scaled
    assert all(math.isfinite(loss) for loss in losses) and strategy.optimizer.last_scaled


def test_ags_in_a_run_of_tokens_or_steps_updates_its_factors_every_20th_of_the_run_unless_told():
    """Once per epoch would be never in a run shorter than one pass; a run of epochs keeps the paper's cadence."""
    net = nn.Linear(4, 2)

    def cadence(**train):
        train_cfg = default_job(train={"strategy": "ags", **train}).train
        return build_strategy(net, train_cfg, global_batch=32, steps_per_epoch=50).optimizer.update_every_steps

    assert cadence(steps=200) == 10
    assert cadence(steps=200, ags={"update_every_steps": 7}) == 7
    assert cadence(epochs=3, lr_milestones=[2]) is None


def _polo_worker(rank: int, train_cfg: TrainSettings, outdir: str) -> None:
    """Three epochs of 4 steps on rank-specific data: in sync for one, then local SGD averaged every 2 steps."""

    def build():
        torch.manual_seed(0)
        net = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        return net, build_strategy(net, train_cfg, global_batch=32, steps_per_epoch=4)

    def run(net, strategy, epochs):
        in_sync = []
        for epoch in epochs:
            for step in range(4):
                gen = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
                x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
                strategy.optimizer.zero_grad()
                F.cross_entropy(net(x), y).backward()
                strategy.before_step(net, IMAGES.loss_of, [x, y])
                strategy.optimizer.step()
                strategy.after_step()
                in_sync.append(_same_on_both_ranks(net))
            strategy.end_epoch()
            in_sync.append(_same_on_both_ranks(net))
        return in_sync

    net, strategy = build()
    in_sync = run(net, strategy, range(3))
    whole = [p.detach().clone() for p in net.parameters()]
    # Interrupted after epoch 2, resumed from rank 0's state as train.py does.
    net, strategy = build()
    run(net, strategy, range(2))
    state = {"model": net.module.state_dict(), "opt": strategy.optimizer.state_dict()}
    box = [state]
    dist.broadcast_object_list(box, src=0)
    net, strategy = build()
    net.module.load_state_dict(box[0]["model"])
    strategy.resume(box[0]["opt"], step=2 * 4)
    resumed_sync = run(net, strategy, [2])
    torch.save(
        {
            "in_sync": in_sync,
            "resumed_sync": resumed_sync,
            "whole": whole,
            "resumed": [p.detach() for p in net.parameters()],
            "hook_iter": strategy.hook_state.iter,
        },
        os.path.join(outdir, f"rank{rank}.pt"),
    )


def _same_on_both_ranks(net: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    same = torch.tensor([float(torch.equal(flat, other))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


@pytest.mark.spawns
def test_polo_is_synchronous_then_local_with_averaging_and_resumes(tmp_path):
    # momentum 0: each rank's momentum buffer is local, and a resume restores rank 0's on both ranks.
    train = dict(
        strategy="polo",
        momentum=0.0,
        warmup_epochs=1,
        epochs=3,
        lr_milestones=[],
        polo={"sync_epochs": 1, "averages_per_epoch": 2},
    )
    train_cfg = default_job(train=train).train
    run_on_two_ranks(_polo_worker, train_cfg, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # Per epoch: 4 steps then the end-of-epoch check. Local phase averages after its 1st and 3rd steps
    # (period 2 from the switch), and the epoch's end closes the gap left by the 4th.
    local = [True, False, True, False, True]
    assert r0["in_sync"] == [True] * 5 + local + local
    assert r0["resumed_sync"] == local
    assert r0["hook_iter"] == 4  # DDP's hook knew it was past the switch after the resume
    for a, b, c in zip(r0["whole"], r0["resumed"], r1["resumed"]):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize(
    "strategy,field,change",
    [
        ("lrs", "train.warmup_epochs", dict(warmup_epochs=30)),
        ("ags", "train.warmup_epochs", dict(warmup_epochs=30, ags={"base": "lars"})),
        ("polo", "train.polo.sync_epochs", dict(polo={"sync_epochs": 30, "averages_per_epoch": 4})),
    ],
)
def test_warm_up_or_sync_phase_covering_every_epoch_is_rejected(strategy, field, change):
    config = load_config([REPO / "config" / "jobs.yaml"])
    config["jobs"]["digits-cnn"]["train"].update(strategy=strategy, epochs=30, **change)
    with pytest.raises(ConfigError, match=f"job 'digits-cnn': field '{field}'.*allowed: below 30"):
        validate_config(config)


def _lr_after_steps(strategy, steps: int) -> float:
    for _ in range(steps):
        strategy.optimizer.step()
        strategy.after_step()
    return strategy.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("name", ["lrs", "lars", "ags"])
def test_a_resume_at_another_batch_follows_the_new_batch_schedule_from_the_same_epoch(name):
    """shrink_global_batch after running out of memory: 2 epochs done at B=256, the run goes on at B=128."""
    train = dict(strategy=name, lr=0.05, lr_base_batch=128, warmup_epochs=3, lr_milestones=[4], lr_gamma=0.1)
    cfg = default_job(train=train).train

    def fresh(batch: int, steps_per_epoch: int):
        model = nn.Linear(4, 3)
        model(torch.ones(8, 4)).sum().backward()
        return build_strategy(model, cfg, global_batch=batch, steps_per_epoch=steps_per_epoch)

    old = fresh(256, 4)
    _lr_after_steps(old, 2 * 4)
    if name == "ags":
        # Every factor at the largest B=256 allows (sqrt(256 / 32)), beyond B=128's range.
        old.optimizer._gradscale = {p: torch.full_like(p, old.optimizer.s_max) for p in old.optimizer._params()}
    saved = old.optimizer.state_dict()

    resumed, reference = fresh(128, 8), fresh(128, 8)
    resumed.resume(copy.deepcopy(saved), step=2 * 8)
    # Step 16 of B=128's 24 warm-up steps towards its peak 0.05 x 128 / 128 (B=256's was twice that); ags: no warm-up.
    expected = 0.05 * 17 / 24 if name in ("lrs", "lars") else 0.05
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert _lr_after_steps(reference, 2 * 8) == pytest.approx(expected)
    assert _lr_after_steps(resumed, 3 * 8) == pytest.approx(0.05 * 0.1)  # epoch 5: past milestone 4
    assert _lr_after_steps(reference, 3 * 8) == pytest.approx(0.05 * 0.1)
    if name == "ags":
        assert resumed.optimizer.s_max == pytest.approx(math.sqrt(128 / 32))
        assert all(
            resumed.optimizer.s_min <= f.min() and f.max() <= resumed.optimizer.s_max
            for f in resumed.optimizer.gradscale.values()
        )


def test_a_resume_at_the_same_batch_is_the_saved_schedule_exactly():
    cfg = default_job(train=dict(strategy="lrs", warmup_epochs=2, lr_milestones=[3])).train
    whole, first = (build_strategy(nn.Linear(2, 2), cfg, global_batch=512, steps_per_epoch=4) for _ in range(2))
    expected = [_lr_after_steps(whole, 1) for _ in range(16)]
    _lr_after_steps(first, 6)
    again = build_strategy(nn.Linear(2, 2), cfg, global_batch=512, steps_per_epoch=4)
    again.resume(first.optimizer.state_dict(), step=6)
    assert [_lr_after_steps(again, 1) for _ in range(10)] == expected[6:]


def _adascale_cfg(**changes) -> TrainSettings:
    train = dict(strategy="adascale", lr=0.1, lr_base_batch=32, epochs=2, lr_milestones=[1], lr_gamma=0.1)
    return default_job(train={**train, **changes}).train


def test_adascale_on_one_rank_is_the_base_recipe_with_gain_one():
    """No second batch size to measure the noise with: each step is worth one base step, at lr, decayed at the
    milestone in base epochs; done after the recipe's progress, within epochs x scale epochs."""
    net = nn.Linear(4, 2)
    strategy = build_strategy(net, _adascale_cfg(), global_batch=128, steps_per_epoch=5)
    assert strategy.noise_scale is None and strategy.scale == 4.0
    assert strategy.target == 2 * 20 and strategy.epochs_left(2, 0) == 8
    rates = []
    while not strategy.finished():
        strategy.before_step(net, None, None)
        rates.append(strategy.optimizer.param_groups[0]["lr"])
        strategy.after_step()
    assert rates == [pytest.approx(0.1)] * 20 + [pytest.approx(0.01)] * 20
    restored = build_strategy(nn.Linear(4, 2), _adascale_cfg(), global_batch=128, steps_per_epoch=5)
    restored.load_state_dict(strategy.state_dict())
    assert restored.finished() and restored.end_epoch()["adascale"]["progress"] == 40
    assert restored.epochs_left(2, 8) == 0  # no progress left: no epoch more


def test_adascale_trains_to_the_recipes_steps_over_the_epochs_samples():
    """The target is train.epochs x ceil(samples / lr_base_batch), as prediction.to_progress counts it (not the
    batch's steps scaled, which counts a partial last step whole); below the base batch the gain can fall to s,
    so the run may take up to 1 / s times the recipe's steps."""
    large = build_strategy(nn.Linear(4, 2), _adascale_cfg(), global_batch=128, steps_per_epoch=5, train_samples=600)
    assert large.target == 2 * 19 and large.epochs_left(2, 0) == 8  # 38 steps of 32; 5 steps an epoch at gain >= 1
    small = build_strategy(nn.Linear(4, 2), _adascale_cfg(), global_batch=16, steps_per_epoch=38, train_samples=600)
    assert small.target == 38 and small.epochs_left(2, 0) == 2  # gain >= 1/2: up to 76 steps of 16
    assert small.epochs_left(2, 0) * small.steps_at_batch * small.scale >= small.target


def _adascale_worker(rank: int, outdir: str) -> None:
    """Two ranks, each its own half of a noisy regression batch: the gain is measured, the same on both ranks, and
    between 1 and the scale."""
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Linear(8, 1))
    strategy = build_strategy(net, _adascale_cfg(), global_batch=128, steps_per_epoch=5)
    generator = torch.Generator().manual_seed(rank)
    gains = []
    for _ in range(30):
        x = torch.randn(64, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True) + 3 * torch.randn(64, 1, generator=generator)
        training_step(net, strategy, REGRESSION, [x, y])
        gains.append(strategy.gain)
    torch.save({"gains": gains, "progress": strategy.progress}, os.path.join(outdir, f"adascale{rank}.pt"))


@pytest.mark.spawns
def test_adascale_gain_is_measured_and_agreed_on_two_ranks(tmp_path):
    run_on_two_ranks(_adascale_worker, str(tmp_path))
    first, second = (torch.load(tmp_path / f"adascale{rank}.pt") for rank in range(2))
    assert first == second
    assert all(1.0 <= g <= 4.0 for g in first["gains"]) and max(first["gains"]) > 1.0
    assert first["progress"] == pytest.approx(sum(first["gains"]))


@pytest.mark.parametrize("optimizer,rate_gain", [("sgd", 2.0), ("adamw", math.sqrt(2.0))])
def test_adascales_rate_follows_the_gain_by_the_optimisers_power_and_progress_the_full_gain(
    one_rank_group, optimizer, rate_gain
):
    """|G|^2 = 4, tr(Sigma) = 256 at base batch 32 (sigma^2 = 8), 4x the base batch: gain (8 + 4) / (8 / 4 + 4) = 2.
    The rate is lr x 2 under SGD, lr x sqrt(2) under Adam (AdaptDL's AdamScale); the progress 2 either way."""
    net = nn.Linear(4, 2)
    strategy = build_strategy(net, _adascale_cfg(optimizer=optimizer), global_batch=128, steps_per_epoch=5)
    strategy.noise_scale = NoiseScaleHook(2)
    strategy.noise_scale.estimate.update(4.0 + 256.0 / 8, 4.0 + 256.0 / 64, 8, 64)
    strategy.before_step(net, None, None)
    assert strategy.gain == pytest.approx(2.0)
    assert strategy.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * rate_gain)
    strategy.after_step()
    assert strategy.progress == pytest.approx(2.0)


def test_the_noise_scale_hook_is_handed_the_current_optimisers_preconditioner():
    """A strategy built at a new batch gives the run's hook its own optimiser's v (Adam) or none (SGD)."""
    hook = NoiseScaleHook(2)
    adam = build_strategy(nn.Linear(4, 2), _adascale_cfg(optimizer="adamw"), 128, 5, noise_scale=hook)
    assert adam.noise_scale is hook and hook.preconditioner.optimizer is adam.optimizer
    sgd = build_strategy(nn.Linear(4, 2), _adascale_cfg(), 128, 5, noise_scale=hook)
    assert sgd.noise_scale is hook and hook.preconditioner is None


def test_polo_wraps_adamw_and_steps(one_rank_group):
    """polo under adamw: PostLocalSGDOptimizer around AdamW over DDP, synchronous then local, the parameters moving."""
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Linear(8, 1))
    train = dict(
        optimizer="adamw",
        strategy="polo",
        epochs=3,
        warmup_epochs=1,
        lr_milestones=[],
        polo={"sync_epochs": 1, "averages_per_epoch": 2},
    )
    strategy = build_strategy(net, default_job(train=train).train, global_batch=16, steps_per_epoch=4)
    assert type(strategy.optimizer.optim) is torch.optim.AdamW and strategy.noise_scale is None
    before = net.module.weight.detach().clone()
    for _ in range(6):
        x = torch.randn(16, 8)
        training_step(net, strategy, REGRESSION, [x, x.sum(dim=1, keepdim=True)])
    assert strategy.optimizer.averager.step == 6 and not torch.equal(before, net.module.weight)
