"""Large-batch training strategies (Tula paper Sec. IV-D, Table I), selected by `train.strategy`.

A strategy is an optimiser (optimizers.py), a per-step learning-rate schedule (lr_schedule.py), the step's precision
(precision.py) and three hooks that the training loop (trainer.py) calls around every optimiser step and at the end of
every epoch; nothing else in the loop knows which strategy runs. This module holds the strategies and their registry.

| strategy | optimiser                                          | peak learning rate          | warm-up |
|----------|----------------------------------------------------|-----------------------------|---------|
| lbt      | SGD or AdamW (vanilla large-batch training)        | lr                          | no      |
| lrs      | SGD (linear LR scaling, Goyal et al.)              | lr x B / lr_base_batch      | yes     |
| lrs      | AdamW (square-root scaling, Malladi et al. 2022)   | lr x sqrt(B / lr_base_batch)| yes     |
| lars     | LARS (optimizers.py)                               | lr x B / lr_base_batch      | yes     |
| lars     | AdamW: LAMB (optimizers.py, You et al. 2020)       | lr x sqrt(B / lr_base_batch)| yes     |
| polo     | PyTorch's PostLocalSGDOptimizer + model averaging  | lr                          | yes     |
| static   | TulaOptimizer, step function U(s) of Eq. 8         | as train.ags.base           | as base |
| ags      | TulaOptimizer, Algorithm 1 (on AdamW's update too) | as train.ags.base           | as base |
| adascale | SGD, the rate times AdaScale's gain (below)        | lr x gain                   | no      |
| adascale | AdamW, AdaptDL's form (below)                      | lr x gain ** 0.5            | no      |

The paper: "LRS and LARS apply linear learning-rate scaling relative to a base batch-size of 128,
while PoLo switches from synchronous to local-SGD after 5 epochs, aggregating updates 4 times every
epoch. All these methods apply LR warmup for 5 epochs." Vanilla LBT and the paper's AGS run without
warm-up: AGS's gate already leaves the sensitive early steps unscaled. ``train.ags.base`` puts AGS (and
static scaling) on top of another recipe: sgd (the paper's: lbt's optimiser and rate), lrs or lars (their
optimiser, linearly scaled rate and warm-up; AGS rescales the gradient the optimiser then steps with).

Under train.optimizer adamw, lars is LAMB, polo wraps AdamW as it wraps SGD, adascale is AdaptDL's form, and static
and ags scale AdamW's update, not its gradient, and leave train.ags.exclude's kinds (embeddings, norms and biases by
default) alone (ags.py). Warm-up above is the multistep schedule's;
train.lr_schedule cosine warms up every strategy over its warmup_steps instead.

adascale (Johnson et al., "AdaScale SGD", ICML 2020) is not a row of Table I: it trains the recipe of
train.epochs at train.lr_base_batch (lbt's: SGD at lr, lr_milestones in those epochs), at a batch s times
larger, each step worth r = adascale_gain(...) base steps by the gradient noise scale DDP's all-reduce measures
(noise_scale.py): the rate is lr x r at the schedule's place, the schedule advances by r per step, and training
ends when it has made the base recipe's progress (epochs x its steps per epoch), after more epochs than the
recipe's (r <= s) but fewer steps than the base batch takes. On one rank there is no second batch size to
measure the noise with: r stays 1 (lbt at lr) and the run says so. Under adamw (AdaptDL's AdamScale) r comes from
the noise scale of the gradient preconditioned by Adam's sqrt(v) + eps, the rate is lr x r ** 0.5 and the schedule
still advances by r (lr_schedule.ADASCALE_RATE_POWER).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from tula_hpc.training.ags import TulaOptimizer
from tula_hpc.training.lr_schedule import ADASCALE_RATE_POWER, lr_factor, peak_lr
from tula_hpc.training.noise_scale import NoiseScaleHook, preconditioner_for
from tula_hpc.training.optimizers import UNSCALED_BY_DEFAULT, build_optimizer, parameter_kinds
from tula_hpc.training.precision import Precision
from tula_hpc.training.progress import adascale_gain, recipe_steps, run_steps
from tula_hpc.training.tasks import batch_size

if TYPE_CHECKING:
    from tula_hpc.core.job import TrainSettings

STRATEGIES = ("lbt", "lrs", "lars", "polo", "static", "ags")  # Table I's
PROFILES_PER_RUN = 20  # AGS's factor updates in a run measured in tokens or steps (ScalingStrategy.run_for)
ADAPTIVE_SCHEDULES = ("adascale",)  # strategies that decide how long they train (not a row of Table I)


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
        self.train_cfg, self.steps_per_epoch = train_cfg, steps_per_epoch
        self.scheduler = LambdaLR(optimizer, lr_factor(train_cfg, steps_per_epoch, train_cfg.epochs * steps_per_epoch))
        self.stop_step: int | None = None  # a run measured in tokens or steps ends at it (`run_for`)
        self.precision = precision
        self.grad_clip = train_cfg.grad_clip  # the global norm apply_update clips the unscaled gradient to
        # The gradient noise scale, measured by DDP's all-reduce (noise_scale.py); None on one rank and for
        # polo, whose local steps all-reduce no gradients.
        self.noise_scale: NoiseScaleHook | None = None

    def reference_indices(self, local_batch: int) -> torch.Tensor | None:
        """Positions of a reference sub-batch this step's gradient must also be taken on, if any."""
        return None

    def before_step(
        self,
        net: nn.Module,
        loss_of: Callable,
        batch,
        reference_grads: dict[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Called after backward (the full, accumulated gradient) and before ``optimizer.step()``.

        ``loss_of(net, batch)`` is the task's (mean loss, count) (tasks.Task.loss_of); ``reference_grads`` map
        parameters to the mean-loss gradients of the sub-batch at ``reference_indices``.
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
        for group, initial in zip(self.optimizer.param_groups, peak):
            group["initial_lr"] = initial
        self.place(step)

    def place(self, step: int) -> None:
        """The rate schedule at step `step` of this run's own schedule: where a resume, or a change of batch
        mid-epoch (the samples trained so far in this batch's steps), puts it."""
        scheduler = self.scheduler
        scheduler.last_epoch = step
        scheduler._last_lr = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, scheduler._last_lr):
            group["lr"] = lr

    def end_epoch(self) -> dict:
        """Called after an epoch's last step, before evaluation and checkpoint; returns metrics to record."""
        return {}

    def run_for(self, total_steps: int) -> None:
        """The run's length in optimiser steps (progress.run_steps): the cosine schedule decays to its last step, and
        under train.tokens or train.steps `finished` says when it is reached, mid-epoch. Every schedule's factor at
        step 0 is the same whatever the length, so the rate already set stands."""
        factor = lr_factor(self.train_cfg, self.steps_per_epoch, total_steps)
        self.scheduler.lr_lambdas = [factor] * len(self.scheduler.lr_lambdas)
        measured = self.train_cfg.tokens is not None or self.train_cfg.steps is not None
        self.stop_step = total_steps if measured else None

    def finished(self) -> bool:
        """Whether training is done before its epochs are: a run measured in tokens or steps at its last step, or a
        strategy that decides how long it trains."""
        return self.stop_step is not None and self.scheduler.last_epoch >= self.stop_step

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

    def run_for(self, total_steps: int) -> None:
        """A run of train.tokens or train.steps, often shorter than one pass over the data, re-estimates the factors
        every PROFILES_PER_RUN-th of its steps where train.ags.update_every_steps is unset: once per epoch, the
        paper's cadence, would there be never, and AGS would silently run as its base recipe."""
        super().run_for(total_steps)
        if self.stop_step is not None and self.train_cfg.ags.update_every_steps is None:
            self.optimizer.update_every_steps = max(1, total_steps // PROFILES_PER_RUN)

    def reference_indices(self, local_batch: int) -> torch.Tensor | None:
        # The reference sub-batch rides along as the step's first micro-batch (no extra forward/backward)
        # when the rest of the batch is left to synchronise the whole gradient; a short last batch
        # defers the update to the next full one (every rank sees equal batch sizes, so all ranks defer
        # together and the factor all-reduce stays matched). delta = 0 never scales: nothing to profile.
        if self._update_due() and local_batch > self.optimizer.small_batch_size:
            return self.optimizer.reference_indices(local_batch)
        return None

    def before_step(self, net, loss_of, batch, reference_grads=None) -> None:
        if reference_grads is not None:
            self.optimizer.update_gradscale_from(reference_grads)
        elif self._update_due() and batch_size(batch) == self.optimizer.small_batch_size:
            # No rest to synchronise: a separate pass, computed as the step's own (precision, memory format).
            precision = self.precision
            with precision.autocast():
                self.optimizer.update_gradscale(
                    net, loss_of, precision.inputs(batch), loss_scale=precision.loss_scale()
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

    def __init__(
        self, name, optimizer, train_cfg, steps_per_epoch, precision, global_batch, train_samples, tokens_per_sample
    ) -> None:
        self.base_batch, self.scale = train_cfg.lr_base_batch, global_batch / train_cfg.lr_base_batch
        self.target = recipe_steps(train_cfg, train_samples, tokens_per_sample)
        self.steps_at_batch = steps_per_epoch
        base_steps = math.ceil(train_samples / train_cfg.lr_base_batch)  # steps per epoch at the base batch
        super().__init__(name, optimizer, dataclasses.replace(train_cfg, warmup_epochs=0), base_steps, precision)
        self.base_factor = lr_factor(dataclasses.replace(train_cfg, strategy="lbt"), base_steps, self.target)
        self.progress, self.gain = 0.0, 1.0
        self.rate_power = ADASCALE_RATE_POWER[train_cfg.optimizer]  # the rate follows gain ** this; progress the gain

    def before_step(self, net, loss_of, batch, reference_grads=None) -> None:
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
            group["lr"] = group["initial_lr"] * self.base_factor(int(self.progress)) * self.gain**self.rate_power

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
    tokens_per_sample: int = 1,
) -> Strategy:
    """The strategy named by train_cfg.strategy for `net` (DDP-wrapped when there are several ranks).

    `train_samples` is an epoch's samples (default: `steps_per_epoch` full global batches); adascale trains to the
    recipe's steps over them. `steps_per_epoch` counts optimiser steps per epoch on each rank; the schedule and polo's
    averaging period are laid out in steps. The step's precision (train.precision, train.channels_last)
    runs on the device of `net`'s parameters. `noise_scale`: the hook an earlier strategy of the same run attached
    (a DDP model takes one comm hook), kept with what it has measured when the batch changes. `tokens_per_sample`
    measures train.tokens (data.seq_len; 1 for images) and the noise scale in tokens. Under adamw the noise scale is
    the preconditioned gradient's (noise_scale.AdamPreconditioner, over this strategy's optimiser).
    """
    name = train_cfg.strategy
    params = list(net.parameters())
    polo = name == "polo" and isinstance(net, DistributedDataParallel)
    precision = Precision(train_cfg.precision, params[0].device, train_cfg.channels_last, local_steps=polo)
    optimizer = build_optimizer(net, train_cfg, peak_lr(train_cfg, global_batch))
    precision.attach_state(optimizer)
    samples = train_samples or steps_per_epoch * global_batch
    strategy = BUILDERS[name](
        name, net, train_cfg, global_batch, steps_per_epoch, samples, optimizer, precision, polo, tokens_per_sample
    )
    strategy.run_for(run_steps(train_cfg, samples, global_batch, tokens_per_sample, steps_per_epoch))
    if noise_scale is None and _world_size(net) > 1 and not polo:
        noise_scale = NoiseScaleHook(_world_size(net), tokens_per_sample=tokens_per_sample)
        noise_scale.attach(net)
    if noise_scale is not None:  # under Adam it reads this strategy's optimiser's v from here on
        noise_scale.preconditioner = preconditioner_for(strategy.optimizer, train_cfg.optimizer)
        strategy.noise_scale = noise_scale
    return strategy


def _scaling(
    name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo, tokens_per_sample
):
    """ags and static: Tula's gradient scaling around the optimiser (Algorithm 1; Eq. 8's step function), on the
    gradient under SGD and on the update under AdamW (ags.py), never on train.ags.exclude's kinds of parameter."""
    ags = train_cfg.ags
    world = _world_size(net)
    module = net.module if isinstance(net, DistributedDataParallel) else net
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
        target="update" if train_cfg.optimizer == "adamw" else "gradient",
        kinds=parameter_kinds(module),
        exclude=UNSCALED_BY_DEFAULT[train_cfg.optimizer] if ags.exclude is None else ags.exclude,
    )
    return ScalingStrategy(name, tula, train_cfg, steps_per_epoch, precision)


def _post_local(
    name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo, tokens_per_sample
):
    """polo: post-local SGD over DDP; on a single process (local SGD with one worker is plain SGD) plain."""
    if not polo:
        return _plain(
            name,
            net,
            train_cfg,
            global_batch,
            steps_per_epoch,
            train_samples,
            optimizer,
            precision,
            polo,
            tokens_per_sample,
        )
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


def _adascale(
    name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo, tokens_per_sample
):
    return AdaScaleStrategy(
        name, optimizer, train_cfg, steps_per_epoch, precision, global_batch, train_samples, tokens_per_sample
    )


def _plain(
    name, net, train_cfg, global_batch, steps_per_epoch, train_samples, optimizer, precision, polo, tokens_per_sample
):
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
