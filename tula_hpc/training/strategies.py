"""Large-batch training strategies (Tula paper Sec. IV-D, Table I), selected by `train.strategy`.

A strategy is an optimiser, a per-step learning-rate schedule, the step's precision and three hooks
that the training loop (trainer.py) calls around every optimiser step and at the end of every epoch; nothing else in the
loop knows which strategy runs.

| strategy | optimiser                                          | peak learning rate          | warm-up |
|----------|----------------------------------------------------|-----------------------------|---------|
| lbt      | SGD (vanilla large-batch training)                 | lr                          | no      |
| lrs      | SGD (linear LR scaling, Goyal et al.)              | lr x B / lr_base_batch      | yes     |
| lars     | LARS (below)                                       | lr x B / lr_base_batch      | yes     |
| polo     | PyTorch's PostLocalSGDOptimizer + model averaging  | lr                          | yes     |
| static   | TulaOptimizer, step function U(s) of Eq. 8         | as train.ags.base           | as base |
| ags      | TulaOptimizer, Algorithm 1                         | as train.ags.base           | as base |
| adascale | SGD, the rate times AdaScale's gain (below)        | lr x gain                   | no      |

The paper: "LRS and LARS apply linear learning-rate scaling relative to a base batch-size of 128,
while PoLo switches from synchronous to local-SGD after 5 epochs, aggregating updates 4 times every
epoch. All these methods apply LR warmup for 5 epochs." Vanilla LBT and the paper's AGS run without
warm-up: AGS's gate already leaves the sensitive early steps unscaled. ``train.ags.base`` puts AGS (and
static scaling) on top of another recipe: sgd (the paper's: lbt's optimiser and rate), lrs or lars (their
optimiser, linearly scaled rate and warm-up; AGS rescales the gradient the optimiser then steps with).

adascale (Johnson et al., "AdaScale SGD", ICML 2020) is not a row of Table I: it trains the recipe of
train.epochs at train.lr_base_batch (lbt's: SGD at lr, lr_milestones in those epochs), at a batch s times
larger, each step worth r = adascale_gain(...) base steps by the gradient noise scale DDP's all-reduce measures
(noise_scale.py): the rate is lr x r at the schedule's place, the schedule advances by r per step, and training
ends when it has made the base recipe's progress (epochs x its steps per epoch), after more epochs than the
recipe's (r <= s) but fewer steps than the base batch takes. On one rank there is no second batch size to
measure the noise with: r stays 1 (lbt at lr) and the run says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from tula_hpc.core.job import LR_SCALING_RECIPES, WARMUP_RECIPES, recipe
from tula_hpc.training.ags import TulaOptimizer
from tula_hpc.training.noise_scale import NoiseScaleHook
from tula_hpc.training.progress import adascale_gain, recipe_steps

if TYPE_CHECKING:
    from tula_hpc.core.job import TrainSettings

STRATEGIES = ("lbt", "lrs", "lars", "polo", "static", "ags")  # Table I's
ADAPTIVE_SCHEDULES = ("adascale",)  # strategies that decide how long they train (not a row of Table I)


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman and Ginsburg, 2017) in torch's momentum-SGD form.

    Per parameter tensor (one layer's weight): d = local_lr * (g + weight_decay * w) with
    local_lr = trust_coefficient * |w| / (|g| + weight_decay * |w| + eps), then v = momentum * v + d and
    w -= lr * v, as torch.optim.SGD applies lr and momentum. A tensor whose weight or gradient norm is 0
    keeps local_lr = 1. Groups with ``adapt=False`` (biases, normalisation layers) take plain SGD
    steps, as TF's exclude_from_layer_adaptation, timm and apex's LARC do.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        adapt: bool = True,
    ) -> None:
        if not lr > 0 or not trust_coefficient > 0:
            raise ValueError(f"lr and trust_coefficient must be > 0, got {lr} and {trust_coefficient}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            adapt=adapt,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.add(p, alpha=decay)
                if group["adapt"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(p.grad)
                    local_lr = group["trust_coefficient"] * w_norm / (g_norm + decay * w_norm + group["eps"])
                    update.mul_(torch.where((w_norm > 0) & (g_norm > 0), local_lr, torch.ones_like(local_lr)))
                if group["momentum"]:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = update.clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                    update = state["momentum_buffer"]
                p.add_(update, alpha=-group["lr"])
        return loss


def peak_lr(train_cfg: TrainSettings, global_batch: int) -> float:
    """The learning rate after warm-up and before decay: linearly scaled for lrs and lars (and AGS on them)."""
    if recipe(train_cfg) in LR_SCALING_RECIPES:
        return train_cfg.lr * global_batch / train_cfg.lr_base_batch
    return train_cfg.lr


def lr_factor(train_cfg: TrainSettings, steps_per_epoch: int) -> Callable[[int], float]:
    """Multiplier of the peak rate at optimiser step k (0-based): linear warm-up, then step decay.

    Warm-up ramps (k + 1) / (warmup_epochs x steps_per_epoch) to 1, per step as in Goyal et al.
    (from peak / warm-up steps rather than their unscaled rate, so that it also applies to polo,
    whose rate is not scaled). Decay multiplies by lr_gamma at each of lr_milestones (epochs), as
    MultiStepLR stepped once per epoch does.
    """
    warm_steps = train_cfg.warmup_epochs * steps_per_epoch if recipe(train_cfg) in WARMUP_RECIPES else 0
    milestones, gamma = train_cfg.lr_milestones, train_cfg.lr_gamma

    def factor(step: int) -> float:
        epoch = step // steps_per_epoch
        decay = gamma ** sum(epoch >= m for m in milestones)
        return decay * min(1.0, (step + 1) / warm_steps) if warm_steps else decay

    return factor


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """How a step computes (train.precision, train.channels_last): autocast, fp16's loss scaling, memory format.

    The strategy holds it so that every caller of the step (training, profiling, memory probing) runs the
    job's precision without knowing of it. Master weights, gradients and the loss stay fp32; bf16 and fp16
    autocast the forward. fp16 multiplies the loss by a GradScaler's scale so small gradients survive its
    narrow range; `unscale` brings ``.grad`` back to true values before any strategy hook reads it.
    """

    def __init__(self, name: str, device: torch.device, channels_last: bool = False, local_steps: bool = False) -> None:
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES[name]
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self.channels_last = channels_last
        self.local_steps = local_steps

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """A batch of images in the model's memory format (a no-op when it already is)."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.ndim == 4 else x

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def scale_on_device(self):
        """The factor ``.grad`` carries, as a device tensor when a scaler keeps one (reading it does not sync)."""
        return 1.0 if self.scaler is None else self.scaler._get_scale_async()

    def loss_scale(self) -> float:
        """The factor ``.grad`` carries until `unscale` (1 without a scaler); reading the scaler's syncs."""
        return 1.0 if self.scaler is None else self.scaler.get_scale()

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide ``.grad`` by the loss scale; returns whether it is finite (always, and without a sync, unscaled).

        The scaler records what it found per device; reading that record is the one check an fp16 step
        needs (GradScaler.step would make the same one). Synchronous ranks hold the same all-reduced
        gradient and decide alike; with `local_steps` (polo's local SGD) each holds its own, so they agree
        on the worst: every rank skips the step and backs off its scale together, and their model averages
        stay matched.
        """
        if self.scaler is None:
            return True
        self.scaler.unscale_(optimizer)
        found = list(self.scaler._found_inf_per_device(optimizer).values())
        if self.local_steps:
            worst = torch.stack(found).amax()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            for flag in found:
                flag.copy_(worst)
        return not any(flag.item() for flag in found)

    def update(self) -> None:
        """After the step: halve the scale after a non-finite gradient, grow it after a run of finite ones."""
        if self.scaler is not None:
            self.scaler.update()

    def attach_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Carry the scaler's state in `optimizer`'s state dict (under ``"grad_scaler"``), so checkpoints keep it.

        Hooks on the innermost optimiser: TulaOptimizer and PostLocalSGDOptimizer build their state dicts
        from its own and hand it its part on load.
        """
        if self.scaler is None:
            return
        scaler = self.scaler

        def save(_, state: dict) -> None:
            state["grad_scaler"] = scaler.state_dict()

        def load(_, state: dict) -> dict:
            state = dict(state)
            if "grad_scaler" in state:
                scaler.load_state_dict(state.pop("grad_scaler"))
            return state

        optimizer.register_state_dict_post_hook(save)
        optimizer.register_load_state_dict_pre_hook(load)


class Strategy:
    """Optimiser, schedule and precision of one run, and the hooks the training loop calls; lbt, lrs and lars need
    no more."""

    def __init__(
        self,
        name: str,
        optimizer: torch.optim.Optimizer,
        train_cfg: TrainSettings,
        steps_per_epoch: int,
        precision: Precision,
    ) -> None:
        self.name = name
        self.optimizer = optimizer
        self.scheduler = LambdaLR(optimizer, lr_factor(train_cfg, steps_per_epoch))
        self.precision = precision
        # The gradient noise scale, measured by DDP's all-reduce (noise_scale.py); None on one rank and for
        # polo, whose local steps all-reduce no gradients.
        self.noise_scale: NoiseScaleHook | None = None

    def reference_indices(self, local_batch: int) -> torch.Tensor | None:
        """Positions of a reference sub-batch this step's gradient must also be taken on, if any."""
        return None

    def before_step(
        self,
        net: nn.Module,
        loss_fn: Callable,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        reference_grads: dict[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Called after backward (the full, accumulated gradient) and before ``optimizer.step()``.

        ``reference_grads`` map parameters to the mean-loss gradients of the sub-batch at
        ``reference_indices``.
        """

    def after_step(self) -> None:
        """Called after every step, also one fp16 skipped for a non-finite gradient: the rate is a function of
        the step count, which is where `resume` places it."""
        self.scheduler.step()

    def resume(self, optimizer_state: dict, step: int) -> None:
        """Go on from a checkpoint's optimiser state at optimiser step `step` of this run's own schedule.

        The schedule is never restored: it is the one built for the batch this run trains at, placed at
        `step`. A relaunch at another global batch or node count (shrink_global_batch after running out
        of memory) then keeps its epoch's place in warm-up and decay at its own peak rate; at the same
        batch this is exactly the saved schedule.
        """
        peak = [group["initial_lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(optimizer_state)
        scheduler = self.scheduler
        scheduler.last_epoch = step
        scheduler._last_lr = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, initial, lr in zip(self.optimizer.param_groups, peak, scheduler._last_lr):
            group.update(initial_lr=initial, lr=lr)

    def end_epoch(self) -> dict:
        """Called after an epoch's last step, before evaluation and checkpoint; returns metrics to record."""
        return {}

    def finished(self) -> bool:
        """Whether training is done before its epochs are (a strategy that decides how long it trains)."""
        return False

    def epochs_left(self, epochs: int, done: int) -> int:
        """The most epochs the run may still take after `done` of train.epochs."""
        return epochs - done

    def state_dict(self) -> dict:
        """What resumes beside the optimiser's state (the checkpoint keeps it)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict`'s contents."""


class ScalingStrategy(Strategy):
    """static and ags: TulaOptimizer profiles when due and reports its per-epoch metrics under ``ags``."""

    def reference_indices(self, local_batch: int) -> torch.Tensor | None:
        # The reference sub-batch rides along as the step's first micro-batch (no extra forward/backward)
        # when the rest of the batch is left to synchronise the whole gradient; a short last batch
        # defers the update to the next full one (every rank sees equal batch sizes, so all ranks defer
        # together and the factor all-reduce stays matched). delta = 0 never scales: nothing to profile.
        if self._update_due() and local_batch > self.optimizer.small_batch_size:
            return self.optimizer.reference_indices(local_batch)
        return None

    def before_step(self, net, loss_fn, inputs, targets, reference_grads=None) -> None:
        if reference_grads is not None:
            self.optimizer.update_gradscale_from(reference_grads)
        elif self._update_due() and inputs.shape[0] == self.optimizer.small_batch_size:
            # No rest to synchronise: a separate pass, computed as the step's own (precision, memory format).
            precision = self.precision
            with precision.autocast():
                self.optimizer.update_gradscale(
                    net, loss_fn, precision.inputs(inputs), targets, loss_scale=precision.loss_scale()
                )

    def _update_due(self) -> bool:
        return self.optimizer.delta > 0 and self.optimizer.needs_update()

    def end_epoch(self) -> dict:
        return {"ags": self.optimizer.pop_epoch_metrics()}

    def resume(self, optimizer_state: dict, step: int) -> None:
        """Factors learnt at another batch are kept within this run's range (s_max = sqrt(B / B_small))."""
        super().resume(optimizer_state, step)
        if self.optimizer.s_max is not None:
            for factor in self.optimizer.gradscale.values():
                factor.clamp_(self.optimizer.s_min, self.optimizer.s_max)


class PostLocalSGDStrategy(Strategy):
    """polo: synchronous for polo.sync_epochs, then local SGD with at least averages_per_epoch model averages.

    Every rank is one local-SGD worker (DDP's comm hook stops gradient all-reduce at the switch). The
    averaging period is steps_per_epoch // averages_per_epoch (at least 1); an epoch whose last step
    was not an averaging step is closed with one more average, so evaluation and the checkpoint (rank
    0's model) see the one model every rank holds. Each rank keeps its own momentum buffer; a resume
    gives every rank rank 0's.
    """

    def __init__(self, name, optimizer, train_cfg, steps_per_epoch, precision, hook_state: PostLocalSGDState) -> None:
        super().__init__(name, optimizer, train_cfg, steps_per_epoch, precision)
        self.hook_state = hook_state

    def resume(self, optimizer_state: dict, step: int) -> None:
        """The averager and DDP's comm hook go on at `step` too: without it the hook would count from 0 and
        all-reduce gradients through a second synchronous phase; the switch is this run's own."""
        super().resume(optimizer_state, step)
        self.optimizer.averager.step = step
        self.hook_state.iter = min(step, self.hook_state.start_localSGD_iter)

    def end_epoch(self) -> dict:
        averager = self.optimizer.averager
        last = averager.step - 1
        if last >= averager.warmup_steps and (last - averager.warmup_steps) % averager.period:
            average_parameters_or_parameter_groups(self.optimizer.param_groups, averager.process_group)
        return {}


class AdaScaleStrategy(Strategy):
    """adascale: the base recipe's schedule, advanced by AdaScale's gain each step (see the module's docstring)."""

    def __init__(self, name, optimizer, train_cfg, steps_per_epoch, precision, global_batch, train_samples) -> None:
        self.base_batch, self.scale = train_cfg.lr_base_batch, global_batch / train_cfg.lr_base_batch
        self.target, self.steps_at_batch = recipe_steps(train_cfg, train_samples), steps_per_epoch
        base_steps = self.target // train_cfg.epochs  # steps per epoch at the base batch
        super().__init__(name, optimizer, dataclasses.replace(train_cfg, warmup_epochs=0), base_steps, precision)
        self.base_factor = lr_factor(dataclasses.replace(train_cfg, strategy="lbt"), base_steps)
        self.progress, self.gain = 0.0, 1.0

    def before_step(self, net, loss_fn, inputs, targets, reference_grads=None) -> None:
        """The gain from the noise scale's averages (this step's gradients included): one read per step."""
        noise = self.noise_scale
        if noise is not None and noise.estimate.steps:
            gradient_sq, trace = noise.estimate.averages()
            # sigma^2 at the base batch; the averages are the ranks' own, which agree in expectation: every rank
            # must step with the same rate, so the gain is taken from the mean over ranks
            both = torch.stack([gradient_sq.clamp(min=0), trace.clamp(min=0) / self.base_batch])
            dist.all_reduce(both)
            gradient_sq, variance = (float(v) / dist.get_world_size() for v in both)
            self.gain = adascale_gain(gradient_sq, variance, self.scale) if gradient_sq + variance > 0 else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.base_factor(int(self.progress)) * self.gain

    def after_step(self) -> None:
        self.progress += self.gain

    def resume(self, optimizer_state: dict, step: int) -> None:
        """The rate is set from the progress before every step: nothing to place but the optimiser's state."""
        initial = [group["initial_lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(optimizer_state)
        for group, rate in zip(self.optimizer.param_groups, initial):
            group["initial_lr"] = rate

    def finished(self) -> bool:
        return self.progress >= self.target

    def epochs_left(self, epochs: int, done: int) -> int:
        # the gain is at least min(1, s) (all noise: s; none: 1), so the progress left takes at most this long at
        # this batch (train.batch_schedule adaptive may have made some of it at another)
        return max(0, math.ceil((self.target - self.progress) / (self.steps_at_batch * min(1.0, self.scale))))

    def end_epoch(self) -> dict:
        return {"adascale": {"progress": self.progress, "target": self.target, "gain": self.gain}}

    def state_dict(self) -> dict:
        return {"progress": self.progress, "gain": self.gain}

    def load_state_dict(self, state: dict) -> None:
        self.progress, self.gain = float(state["progress"]), float(state["gain"])


def _world_size(net: nn.Module) -> int:
    return dist.get_world_size() if isinstance(net, DistributedDataParallel) else 1


def build_strategy(
    net: nn.Module,
    train_cfg: TrainSettings,
    global_batch: int,
    steps_per_epoch: int,
    train_samples: int | None = None,
    noise_scale: NoiseScaleHook | None = None,
) -> Strategy:
    """The strategy named by train_cfg.strategy for `net` (DDP-wrapped when there are several ranks).

    `train_samples` is an epoch's samples (default: `steps_per_epoch` full global batches); adascale trains to the
    recipe's steps over them. `steps_per_epoch` counts optimiser steps per epoch on each rank; the schedule and polo's
    averaging period are laid out in steps. The step's precision (train.precision, train.channels_last)
    runs on the device of `net`'s parameters. `noise_scale`: the hook an earlier strategy of the same run attached
    (a DDP model takes one comm hook), kept with what it has measured when the batch changes.
    """
    name = train_cfg.strategy
    lr = peak_lr(train_cfg, global_batch)
    sgd = dict(lr=lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay)
    params = list(net.parameters())
    polo = name == "polo" and isinstance(net, DistributedDataParallel)
    precision = Precision(train_cfg.precision, params[0].device, train_cfg.channels_last, local_steps=polo)
    if recipe(train_cfg) == "lars":
        layers = [p for p in params if p.ndim > 1]
        others = [p for p in params if p.ndim <= 1]
        optimizer = LARS(
            [{"params": layers}, {"params": others, "adapt": False}],
            **sgd,
            trust_coefficient=train_cfg.lars.trust_coefficient,
        )
    else:
        optimizer = torch.optim.SGD(params, **sgd)
    precision.attach_state(optimizer)
    samples = train_samples or steps_per_epoch * global_batch
    strategy = BUILDERS[name](name, net, train_cfg, global_batch, steps_per_epoch, samples, optimizer, precision, polo)
    if noise_scale is not None:
        strategy.noise_scale = noise_scale
    elif _world_size(net) > 1 and not polo:
        strategy.noise_scale = NoiseScaleHook(_world_size(net))
        strategy.noise_scale.attach(net)
    return strategy


def _scaling(name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo):
    """ags and static: Tula's gradient scaling around the optimiser (Algorithm 1; Eq. 8's step function)."""
    ags = train_cfg.ags
    world = _world_size(net)
    tula = TulaOptimizer(
        optimizer,
        mode="static" if name == "static" else "adaptive",
        delta=ags.delta,
        large_batch_size=global_batch,
        small_batch_size=min(ags.small_batch, global_batch // world),
        granularity=ags.granularity,
        s_min=ags.s_min,
        static_scale=ags.static_scale,
        update_every_steps=ags.update_every_steps,
        seed=train_cfg.seed,
    )
    return ScalingStrategy(name, tula, train_cfg, steps_per_epoch, precision)


def _post_local(name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo):
    """polo: post-local SGD over DDP; on a single process (local SGD with one worker is plain SGD) plain."""
    if not polo:
        return _plain(name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo)
    switch = train_cfg.polo.sync_epochs * steps_per_epoch
    hook_state = PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=switch, post_local_gradient_allreduce=False
    )
    net.register_comm_hook(hook_state, post_localSGD_hook)
    period = max(1, steps_per_epoch // train_cfg.polo.averages_per_epoch)
    averager = PeriodicModelAverager(period=period, warmup_steps=switch)
    # Here, not at the top: torch.distributed.optim brings FSDP and DTensor, 0.56 s of every worker's start.
    from torch.distributed.optim import PostLocalSGDOptimizer

    return PostLocalSGDStrategy(
        name, PostLocalSGDOptimizer(optimizer, averager), train_cfg, steps_per_epoch, precision, hook_state
    )


def _adascale(name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo):
    return AdaScaleStrategy(name, optimizer, train_cfg, steps_per_epoch, precision, global_batch, train_samples)


def _plain(name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo):
    """lbt, lrs, lars: the optimiser as it is (the recipe, `recipe`, chose its rate, warm-up and LARS)."""
    return Strategy(name, optimizer, train_cfg, steps_per_epoch, precision)


# The registry of train.strategy: each name's builder (the schema's enum is checked against it by a test).
BUILDERS = {
    "ags": _scaling,
    "static": _scaling,
    "lbt": _plain,
    "lrs": _plain,
    "lars": _plain,
    "polo": _post_local,
    "adascale": _adascale,
}
