"""TulaOptimizer (Adaptive Gradient Scaling): real torch, tiny models, CPU only."""

import copy
import io
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import MultiStepLR

from tests.conftest import run_on_two_ranks
from tula_hpc.config import SCHEMA_PATH
from tula_hpc.training.ags import GRANULARITIES, TulaOptimizer
from tula_hpc.training.optimizers import parameter_kinds
from tula_hpc.training.tasks import ImageClassification

LOSS_OF = ImageClassification().loss_of  # (mean cross-entropy, count) of a model on a pair batch


def _mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4))


def _batch(gen: torch.Generator | None, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 6, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def test_delta_follows_hand_computed_norms_and_gates_scaling():
    a, b = torch.zeros(2), torch.zeros(1)
    opt = TulaOptimizer(torch.optim.SGD([a, b], lr=1.0), mode="static", static_scale=2.0, delta=0.5)

    def step(ga, gb):
        a.grad, b.grad = torch.tensor(ga), torch.tensor(gb)
        opt.step()

    step([3.0, 4.0], [0.0])  # |g|^2 = 25, no previous norm: sensitive
    assert opt.last_delta == math.inf and not opt.last_scaled
    assert a.tolist() == [-3.0, -4.0]

    step([3.0, 4.0], [2.0])  # |g|^2 = 29: Delta = 4/25 = 0.16 < 0.5 -> x2
    assert opt.last_delta == pytest.approx(4 / 25) and opt.last_scaled
    assert a.tolist() == [-9.0, -12.0] and b.tolist() == [-4.0]

    step([6.0, 8.0], [0.0])  # |g|^2 = 100: Delta = 71/29 >= 0.5 -> unscaled
    assert opt.last_delta == pytest.approx(71 / 29) and not opt.last_scaled
    assert a.tolist() == [-15.0, -20.0] and a.grad.tolist() == [6.0, 8.0]


@pytest.mark.parametrize("granularity", ["element", "tensor"])
def test_profiling_keeps_factors_in_bounds_and_leaves_training_state_alone(granularity):
    torch.manual_seed(0)
    model = _mlp()
    opt = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        large_batch_size=64,
        small_batch_size=4,
        granularity=granularity,
    )
    assert opt.s_max == 4.0 and opt.s_min == 0.25
    x, y = _batch(torch.Generator().manual_seed(1))
    _backward(model, x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()

    opt.update_gradscale(model, LOSS_OF, [x, y])

    scales = [opt.gradscale[p] for p in model.parameters()]
    flat = torch.cat([s.reshape(-1) for s in scales])
    assert flat.min() >= opt.s_min and flat.max() <= opt.s_max
    if granularity == "element":
        assert all(s.shape == p.shape for s, p in zip(scales, model.parameters()))
        # 4 noisy samples vs 64: the clamp must actually be doing work at both ends
        assert flat.min() == opt.s_min and flat.max() == opt.s_max
    else:
        assert all(s.dim() == 0 for s in scales)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # BN stats too
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("granularity", ["element", "tensor"])
def test_factor_is_small_over_large_gradient(granularity):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        large_batch_size=256,
        small_batch_size=16,
        granularity=granularity,
    )
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    _backward(model, x, y)
    for p in model.parameters():
        p.grad.mul_(0.5)  # the large-batch gradient is half of the (whole-batch) sub-batch one

    opt.update_gradscale(model, LOSS_OF, [x, y])

    for p in model.parameters():
        torch.testing.assert_close(opt.gradscale[p], torch.full_like(opt.gradscale[p], 2.0), rtol=1e-3, atol=0)


@pytest.mark.parametrize("granularity", ["element", "tensor"])  # tensor factors are gated as one stacked vector
def test_sensitive_steps_leave_gradients_unchanged(granularity):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    ref = copy.deepcopy(model)
    opt = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        large_batch_size=256,
        small_batch_size=4,
        granularity=granularity,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    _backward(model, x, y)
    opt.update_gradscale(model, LOSS_OF, [x, y])
    scales = [opt.gradscale[p] for p in model.parameters()]
    assert not all(torch.equal(s, torch.ones_like(s)) for s in scales)

    base = [torch.randn_like(p) for p in model.parameters()]
    for k in range(4):  # |g|^2 quadruples every step: Delta = 3 >= 0.5
        for p, q, g in zip(model.parameters(), ref.parameters(), base):
            p.grad, q.grad = g * 2**k, g * 2**k
        opt.step()
        ref_opt.step()
        assert not opt.last_scaled
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))

    for p, q, g, s in zip(model.parameters(), ref.parameters(), base, scales):  # Delta = 0: scaled
        p.grad, q.grad = g * 8, (g * 8).mul_(s)
    opt.step()
    ref_opt.step()
    assert opt.last_scaled
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_delta_zero_reproduces_wrapped_sgd_bit_for_bit():
    def train(wrap: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _mlp(dropout=0.2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        if wrap:
            opt = TulaOptimizer(opt, delta=0.0, large_batch_size=64, small_batch_size=8, update_every_steps=2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = _batch(gen)
            opt.zero_grad()
            _backward(model, x, y)
            if wrap and opt.needs_update():
                opt.update_gradscale(model, LOSS_OF, [x, y])
            opt.step()
        if wrap:
            assert opt.pop_epoch_metrics()["gradscale_updates"] == 2
        return model

    plain, wrapped = train(False), train(True)
    for (name, p), q in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        assert torch.equal(p, q), name


def _ddp_worker(rank: int, world: int, outdir: str) -> None:
    """Five steps of AGS under DDP on rank-specific data (run by run_on_two_ranks)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(_mlp())
    opt = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        delta=math.inf,  # scale every step with a defined Delta
        large_batch_size=world * 32,
        small_batch_size=4,
        update_every_steps=2,
    )
    gen = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
    for _ in range(5):
        x, y = _batch(gen, 32)
        opt.zero_grad()
        _backward(model, x, y)
        if opt.needs_update():
            opt.update_gradscale(model, LOSS_OF, [x, y])
        opt.step()
    torch.save(
        {
            "params": [p.detach() for p in model.module.parameters()],
            "gradscale": [opt.gradscale[p] for p in model.module.parameters()],
            "metrics": opt.pop_epoch_metrics(),
        },
        os.path.join(outdir, f"rank{rank}.pt"),
    )


@pytest.mark.spawns
def test_ddp_ranks_end_with_identical_factors_and_weights(tmp_path):
    run_on_two_ranks(_ddp_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["metrics"]["gradscale_updates"] == 2 and r0["metrics"]["scaled_steps"] == 4
    assert not all(torch.equal(s, torch.ones_like(s)) for s in r0["gradscale"])
    assert all(torch.equal(a, b) for a, b in zip(r0["gradscale"], r1["gradscale"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def _build(seed: int):
    torch.manual_seed(seed)
    model = _mlp(dropout=0.2)
    opt = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
        delta=math.inf,
        large_batch_size=32,
        small_batch_size=8,
    )
    return model, opt, MultiStepLR(opt, milestones=[2], gamma=0.1)


def _train(model, opt, sched, positions, steps_per_epoch=3):
    for _, step in positions:
        x, y = _batch(None, 32)  # global RNG, so its checkpointed state matters
        opt.zero_grad()
        _backward(model, x, y)
        if opt.needs_update():
            opt.update_gradscale(model, LOSS_OF, [x, y])
        opt.step()
        if step == steps_per_epoch - 1:
            sched.step()
            opt.pop_epoch_metrics()


def test_resume_mid_epoch_matches_uninterrupted_run():
    positions = [(e, s) for e in range(3) for s in range(3)]
    model, opt, sched = _build(0)
    _train(model, opt, sched, positions)

    first, opt_a, sched_a = _build(0)
    _train(first, opt_a, sched_a, positions[:4])  # stop inside epoch 2, after its profile
    buf = io.BytesIO()
    torch.save(
        {
            "model": first.state_dict(),
            "opt": opt_a.state_dict(),
            "sched": sched_a.state_dict(),
            "rng": torch.get_rng_state(),
        },
        buf,
    )
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, opt_b, sched_b = _build(1)
    resumed.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    sched_b.load_state_dict(ckpt["sched"])
    torch.set_rng_state(ckpt["rng"])
    _train(resumed, opt_b, sched_b, positions[4:])

    assert opt_b.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # milestone crossed after resume
    assert opt_b.state_dict()["tula"]["updates"] == 2
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name


def test_multisteplr_on_wrapper_drives_the_inner_learning_rate():
    p = torch.zeros(2)
    opt = TulaOptimizer(torch.optim.SGD([p], lr=1.0), delta=0.0, large_batch_size=64)
    sched = MultiStepLR(opt, milestones=[1, 2], gamma=0.1)
    expected = [-1.0, -1.1, -1.11]
    for k, want in enumerate(expected):
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
        torch.testing.assert_close(p, torch.full((2,), want))
        if k == 0:  # the inner load replaces its group list; the scheduler must still reach it
            opt.load_state_dict(opt.state_dict())
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_update_cadence_and_epoch_metrics():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _batch(torch.Generator().manual_seed(1))
    every2 = TulaOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), large_batch_size=64, small_batch_size=8, update_every_steps=2
    )
    epochly = TulaOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), large_batch_size=64, small_batch_size=8)
    _backward(model, x, y)

    due = []
    for _ in range(5):
        due.append(every2.needs_update())
        if due[-1]:
            every2.update_gradscale(model, LOSS_OF, [x, y])
        every2.step()
    assert due == [False, False, True, False, True]

    assert not epochly.needs_update()
    epochly.step()
    metrics = epochly.pop_epoch_metrics()
    assert epochly.needs_update()
    epochly.update_gradscale(model, LOSS_OF, [x, y])
    assert not epochly.needs_update()

    metrics = every2.pop_epoch_metrics()
    json.dumps(metrics, allow_nan=False)
    assert metrics["steps"] == 5 and metrics["gradscale_updates"] == 2
    assert metrics["scaled_fraction"] == metrics["scaled_steps"] / 5
    assert metrics["nonfinite_delta_steps"] == 1  # the first step has no previous norm
    assert metrics["delta"]["min"] <= metrics["delta"]["median"] <= metrics["delta"]["max"]
    hist = metrics["scale_hist"]
    assert len(hist["edges"]) == every2.hist_bins + 1
    assert hist["edges"][0] == pytest.approx(every2.s_min) and hist["edges"][-1] == pytest.approx(every2.s_max)
    assert sum(hist["counts"]) == sum(p.numel() for p in model.parameters())

    static = TulaOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), mode="static", static_scale=4.0)
    assert not static.needs_update()
    with pytest.raises(RuntimeError):
        static.update_gradscale(model, LOSS_OF, [x, y])
    assert static.pop_epoch_metrics()["scale_hist"] is None


@pytest.mark.parametrize("target", ["gradient", "update"])  # the update form on SGD without decay: its own reads
@pytest.mark.parametrize("mode", ["adaptive", "static"])
def test_a_training_step_never_reads_a_device_value_back(mode, target, monkeypatch):
    """On a GPU every read-back stalls the host until the device catches up; the gate must decide on the device."""
    torch.manual_seed(0)
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = TulaOptimizer(sgd, mode=mode, large_batch_size=64, small_batch_size=8, target=target)
    x, y = _batch(torch.Generator().manual_seed(1))
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    for _ in range(2):  # an ordinary step before and after the first norm
        opt.zero_grad()
        _backward(model, x, y)
        opt.step()
    assert reads == []
    opt.pop_epoch_metrics()  # reads the epoch's Deltas back once, and makes an update due
    reads.clear()
    for _ in range(2):  # the step that carries the update, then a scaled one
        opt.zero_grad()
        _backward(model, x, y)
        if opt.needs_update():
            opt.update_gradscale_from({p: p.grad * 2 for p in model.parameters()})
        opt.step()
    assert reads == []
    monkeypatch.undo()
    assert opt.pop_epoch_metrics()["scaled_steps"] == 2  # the scaling path ran too


def test_the_schemas_granularities_are_the_optimisers():
    jobs = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["jobs"]["additionalProperties"]
    assert tuple(jobs["properties"]["train"]["properties"]["ags"]["properties"]["granularity"]["enum"]) == GRANULARITIES


@pytest.mark.parametrize("mode, factor", [("static", 3.0), ("adaptive", 2.0)])
def test_under_adamw_the_factor_scales_the_update_and_neither_the_moments_nor_the_decay(mode, factor):
    """Known answer: the change is s x plain AdamW's update plus its unscaled decay; the moments are plain AdamW's."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    ref = nn.Parameter(w.detach().clone())
    lr, decay = 0.01, 0.1
    opt = TulaOptimizer(
        torch.optim.AdamW([w], lr=lr, weight_decay=decay),
        mode=mode,
        static_scale=factor,
        delta=math.inf,  # every step with a Delta is scaled
        large_batch_size=64,
        small_batch_size=4,
        granularity="model",
        target="update",
    )
    plain = torch.optim.AdamW([ref], lr=lr, weight_decay=decay)
    for step in range(3):
        g = torch.randn(3, 4)
        w.grad, ref.grad = g.clone(), g.clone()
        if mode == "adaptive" and step == 0:
            opt.update_gradscale_from({w: factor * g})  # the small batch's gradient twice the large one's
        before, ref_before = w.detach().clone(), ref.detach().clone()
        opt.step()
        plain.step()
        s = 1.0 if step == 0 else factor  # the first step has no Delta: sensitive
        update = ref - ref_before * (1 - lr * decay)
        torch.testing.assert_close(w - before * (1 - lr * decay), s * update, atol=1e-6, rtol=1e-6)
        assert all(torch.equal(opt.state[w][key], plain.state[ref][key]) for key in ("exp_avg", "exp_avg_sq", "step"))
        assert torch.equal(w.grad, g)


def test_the_update_form_refuses_a_decay_coupled_to_the_gradient():
    with pytest.raises(ValueError, match="couples its decay"):
        TulaOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, weight_decay=0.1), target="update")


@pytest.mark.parametrize("inner, target", [(torch.optim.AdamW, "update"), (torch.optim.SGD, "gradient")])
def test_excluded_kinds_are_never_scaled(inner, target):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    kinds = parameter_kinds(model)
    opt = TulaOptimizer(
        inner(model.parameters(), lr=0.1),
        mode="static",
        delta=math.inf,
        target=target,
        kinds=kinds,
        exclude=("embeddings", "norms", "biases"),
    )
    plain = inner(reference.parameters(), lr=0.1)
    for _ in range(2):  # the second step is scaled, its gradients taken where both models still agree
        ids = torch.randint(0, 7, (5,))
        for net, optimizer in ((model, opt), (reference, plain)):
            optimizer.zero_grad()
            net(ids).square().mean().backward()
            optimizer.step()
    assert opt.last_scaled
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q) == (kinds[p] != "weights"), kinds[p]


def _shared_factor_problem() -> tuple[list[nn.Parameter], dict, dict]:
    """Parameters with known large-batch gradients (bias norm 5, weights' together sqrt 2, the norm's excluded), their
    kinds, and small-batch gradients: bias norm 10, weights' 2."""
    bias, w1, w2, norm = (nn.Parameter(torch.zeros(shape)) for shape in [(2,), (2, 2), (1, 2), (2,)])
    bias.grad, w1.grad, w2.grad = (
        torch.tensor([3.0, 4.0]),
        torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        torch.tensor([[0.0, 1.0]]),
    )
    norm.grad = torch.tensor([100.0, 0.0])
    kinds = {bias: "biases", w1: "weights", w2: "weights", norm: "norms"}
    small = {bias: torch.tensor([6.0, 8.0]), w1: torch.ones(2, 2), w2: torch.zeros(1, 2), norm: torch.zeros(2)}
    return [bias, w1, w2, norm], kinds, small


@pytest.mark.parametrize(
    "granularity, bias_small, expected",
    [
        ("group", [6.0, 8.0], (2.0, math.sqrt(2))),  # 10 / 5; 2 / sqrt 2
        ("group", [60.0, 80.0], (4.0, math.sqrt(2))),  # 100 / 5, clamped to s_max = sqrt(64 / 4)
        ("model", [6.0, 8.0], (math.sqrt(104 / 27),) * 2),  # sqrt(10^2 + 2^2) / sqrt(5^2 + 2), the norm left out
        ("model", [60.0, 80.0], (4.0, 4.0)),
    ],
)
def test_group_and_model_factors_are_the_clamped_ratios_of_their_shares_norms(granularity, bias_small, expected):
    params, kinds, small = _shared_factor_problem()
    small[params[0]] = torch.tensor(bias_small)
    opt = TulaOptimizer(
        torch.optim.SGD(params, lr=0.1),
        large_batch_size=64,
        small_batch_size=4,
        granularity=granularity,
        kinds=kinds,
        exclude=("norms",),
    )
    opt.update_gradscale_from(small)
    factors = opt.gradscale
    assert params[3] not in factors  # excluded: exactly 1
    bias, weights = expected
    assert [float(factors[p]) for p in params[:3]] == pytest.approx([bias, weights, weights], rel=1e-6)
