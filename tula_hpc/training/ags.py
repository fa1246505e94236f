"""Adaptive Gradient Scaling (AGS), Tula paper Sec. III-B/III-C, Algorithm 1, Eq. 5-8.

Large-batch gradients are smoother than small-batch ones and steer training
towards sharp minima. AGS multiplies them by per-parameter factors that move
their magnitude towards what a small reference batch would produce, but only
outside sensitive phases, which are detected online from the relative change
of the squared gradient norm (Eq. 5). The static step function U(s) of Eq. 8
is the same gate with one fixed factor.

Under SGD a factor multiplies the gradient (the paper's form). Under AdamW it multiplies the step's update,
lr x m_hat / (sqrt(v_hat) + eps), instead (``target="update"``): a factor on the gradient would cancel in
m / sqrt(v) once v has adapted and enlarge the step while v lags, whereas on the update it is the paper's change of
step size, with Adam's moments and the decoupled weight decay exactly those of plain AdamW.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tula_hpc.training.tasks import batch_size, select

__all__ = ["GRANULARITIES", "TulaOptimizer"]

GRANULARITIES = ("element", "tensor", "group", "model")  # what one factor covers (TulaOptimizer's docstring)


def _check_form(optimizer: torch.optim.Optimizer, granularity: str, target: str) -> None:
    """What one factor covers, and what it multiplies: the update only where `optimizer` decays the weights apart
    from it (AdamW's decoupled decay, Loshchilov and Hutter) or not at all, as the update form leaves decay unscaled."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if target not in ("gradient", "update"):
        raise ValueError(f"target must be 'gradient' or 'update', got {target!r}")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay")
    if target == "update" and not decoupled and any(group.get("weight_decay") for group in optimizer.param_groups):
        raise ValueError(
            f"target 'update' leaves AdamW's decoupled weight decay unscaled; {type(optimizer).__name__} couples its "
            "decay to the gradient: use target 'gradient'"
        )


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm over all gradients, a float64 scalar left on their device (reading it would sync).

    Norms are taken in the gradients' own dtype (foreach kernels where the
    device has them); casting every gradient to float64 first cost ~40x more
    (155 ms vs 3.5 ms per step for resnet18 on the CPU). float32 norms resolve
    Delta to ~1e-6, far below any useful threshold delta.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads).double().square()


class EpochLog:
    """What the open epoch recorded: its steps, factor updates, and each step's Delta and gate as device scalars,
    read back once at the epoch's end (`values`), so that an ordinary step never waits for the device."""

    def __init__(self) -> None:
        self.steps, self.updates = 0, 0
        self.deltas: list[torch.Tensor] = []
        self.gates: list[torch.Tensor] = []

    def record_step(self, delta: torch.Tensor, gate: torch.Tensor) -> None:
        self.steps += 1
        self.deltas.append(delta)
        self.gates.append(gate)

    def values(self) -> dict[str, Any]:
        """The epoch as plain data, its device scalars read back: one sync for the whole epoch."""
        deltas = torch.stack(self.deltas).cpu().tolist() if self.deltas else []
        gates = torch.stack(self.gates).cpu().tolist() if self.gates else []
        return {"steps": self.steps, "updates": self.updates, "deltas": deltas, "gates": gates}

    @classmethod
    def from_values(cls, values: dict[str, Any], device: torch.device) -> EpochLog:
        """The log `values` wrote, its scalars back on `device` (a checkpoint's open epoch)."""
        log = cls()
        log.steps, log.updates = values["steps"], values["updates"]
        log.deltas = [torch.tensor(d, dtype=torch.float64, device=device) for d in values["deltas"]]
        log.gates = [torch.tensor(g, device=device) for g in values["gates"]]
        return log


class TulaOptimizer(torch.optim.Optimizer):
    """Wraps any optimiser and rescales its large-batch gradients (AGS).

    The wrapper shares ``param_groups`` and ``state`` with the inner
    optimiser, so LR schedulers, ``zero_grad`` and gradient-clipping code may
    target either object. It only touches ``.grad`` right before the inner
    step, so it works unchanged under DDP (gradients are already all-reduced
    and identical on every rank, hence so are Delta and the scaling decision).

    Args:
        optimizer: the optimiser whose update is rescaled.
        mode: ``"adaptive"`` (Algorithm 1, profiled per-parameter factors) or
            ``"static"`` (Eq. 8, one fixed factor ``static_scale``, no profiling).
        delta: sensitivity threshold; a step is scaled only when Delta < delta.
            The paper's default 0.5 was its best trade-off across models;
            ``delta=0`` never scales and reproduces ``optimizer`` bit for bit.
        large_batch_size: global large batch B_large (all ranks together);
            required in adaptive mode because it fixes s_max = sqrt(B_large/B_small).
        small_batch_size: reference small batch B_small sampled from each
            rank's local batch during profiling (paper default 32).
        granularity: ``"element"`` is the paper's per-entry ratio; ``"tensor"``
            uses one ratio of norms per parameter tensor, which is far less
            noisy for a 32-sample reference batch and costs no extra memory;
            ``"group"`` one ratio of norms per parameter kind (``kinds``), over
            all the kind's tensors; ``"model"`` one ratio of the global norms
            of every scaled parameter.
        s_min: floor of the factors. Lemma 1 (Eq. 10-13) needs s_min > 0 and
            only admits learning rates eta < 2 s_min / (L s_max^2), so a floor
            near zero voids the guarantee and would freeze entries whose
            small-batch gradient happened to be ~0 until the next profile. The
            default ``1 / s_max`` makes the range symmetric in log space: AGS
            may shrink an update exactly as much as it may grow it, and the
            spread s_max / s_min equals B_large / B_small, the same factor the
            linear LR-scaling rule spans between the two batch sizes.
        static_scale: the factor s of U(s) in static mode (the paper found 2
            safe for all models; larger values hurt AlexNet).
        update_every_steps: profile every k optimiser steps instead of once
            per epoch (the paper's default); see :meth:`needs_update`.
        eps: stability term of Algorithm 1, line 16.
        seed: seeds the sub-batch sampler, whose state is checkpointed.
        hist_bins: number of log-spaced bins between s_min and s_max for the
            per-epoch histogram of factors (Fig. 7 densities).
        process_group: group over which profiled factors are averaged when
            ``torch.distributed`` is initialised (default: the world).
        target: ``"gradient"`` (SGD's form: the factor multiplies ``.grad``)
            or ``"update"`` (Adam's: it multiplies the change the inner step
            makes less its decoupled weight decay, see :meth:`_scaled_update_step`).
        kinds: each parameter's kind (optimizers.parameter_kinds); ``None``:
            all one kind. ``"group"`` granularity measures a factor per kind.
        exclude: kinds never scaled: their factor is exactly 1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        mode: str = "adaptive",
        delta: float = 0.5,
        large_batch_size: int | None = None,
        small_batch_size: int = 32,
        granularity: str = "element",
        s_min: float | None = None,
        static_scale: float = 2.0,
        update_every_steps: int | None = None,
        eps: float = 1e-8,
        seed: int = 0,
        hist_bins: int = 16,
        process_group: dist.ProcessGroup | None = None,
        target: str = "gradient",
        kinds: dict[torch.Tensor, str] | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        if mode not in ("adaptive", "static"):
            raise ValueError(f"mode must be 'adaptive' or 'static', got {mode!r}")
        _check_form(optimizer, granularity, target)
        if not delta >= 0:
            raise ValueError(f"delta must be >= 0, got {delta}")
        if hist_bins < 1:
            raise ValueError(f"hist_bins must be >= 1, got {hist_bins}")
        if update_every_steps is not None and update_every_steps < 1:
            raise ValueError(f"update_every_steps must be >= 1, got {update_every_steps}")
        if mode == "static":
            if not static_scale > 0:
                raise ValueError(f"static_scale must be > 0, got {static_scale}")
            s_max = None
        else:
            if large_batch_size is None or large_batch_size < small_batch_size or small_batch_size < 1:
                raise ValueError(
                    "adaptive mode needs 1 <= small_batch_size <= large_batch_size, got "
                    f"small_batch_size={small_batch_size}, large_batch_size={large_batch_size}"
                )
            s_max = math.sqrt(large_batch_size / small_batch_size)
            s_min = 1.0 / s_max if s_min is None else s_min
            if not 0 < s_min <= s_max:
                raise ValueError(f"need 0 < s_min <= s_max={s_max:.4g}, got s_min={s_min}")

        # The base constructor installs hook tables and step profiling; its own
        # copy of the groups is then dropped in favour of the inner lists.
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.optimizer = optimizer
        self._share_inner()

        self.mode = mode
        self.delta = delta
        self.large_batch_size = large_batch_size
        self.small_batch_size = small_batch_size
        self.granularity = granularity
        self.s_min = s_min if mode == "adaptive" else None
        self.s_max = s_max
        self.static_scale = static_scale
        self.update_every_steps = update_every_steps
        self.eps = eps
        self.hist_bins = hist_bins
        self.process_group = process_group
        self.target = target
        # The scaled parameters by kind, in the inner optimiser's order; the others keep a factor of exactly 1.
        self._kinds = {p: kind for p in self._params() if (kind := (kinds or {}).get(p, "weights")) not in exclude}

        self._set_gradscale({})
        self._generator = torch.Generator().manual_seed(seed)
        self._steps = 0
        self._scaled_steps = 0  # steps scaled in closed epochs; the open epoch's gates are still on the device
        self._updates = 0
        self._steps_since_update = 0
        self._update_due = False
        # Device scalars: the gate decides on the device, so an ordinary step never waits for it.
        self._last_sq_norm: torch.Tensor | None = None
        self._last_delta = torch.tensor(math.inf, dtype=torch.float64)
        self._last_scaled = torch.tensor(False)
        self._epoch = EpochLog()

    def _share_inner(self) -> None:
        # The inner load_state_dict replaces its lists; re-pointing keeps
        # schedulers attached to the wrapper driving the inner step.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def gradscale(self) -> dict[torch.Tensor, torch.Tensor]:
        """Current factors by parameter; a missing entry means 1 (Algorithm 1's initial value)."""
        return dict(self._gradscale)

    @property
    def last_delta(self) -> float:
        """Delta of the latest step; ``inf`` when undefined (first step, or previous norm 0). Reading it syncs."""
        return self._last_delta.item()

    @property
    def last_scaled(self) -> bool:
        """Whether the latest step was scaled (Delta < delta). Reading it syncs."""
        return bool(self._last_scaled)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Gate, scale in place, then run the inner step.

        A closure is evaluated once before the gate; optimisers that re-evaluate
        it inside their step (LBFGS) are not supported because AGS must see the
        final gradient. After a scaled step ``.grad`` holds the scaled gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sq_norm = _squared_norm([p.grad for p in self._params() if p.grad is not None])
        prev = self._last_sq_norm
        # Eq. 5; undefined without a non-zero previous norm -> treat as sensitive.
        if prev is None:
            self._last_delta = torch.full_like(sq_norm, math.inf)
        else:
            self._last_delta = torch.where(prev != 0, ((sq_norm - prev) / prev).abs(), math.inf)
        self._last_sq_norm = sq_norm
        self._last_scaled = self._last_delta < self.delta
        params, factors = self._gated_factors()
        if self.target == "gradient":
            if params:
                torch._foreach_mul_([p.grad for p in params], factors)
            self.optimizer.step()
        else:
            self._scaled_update_step(params, factors)

        self._steps += 1
        self._steps_since_update += 1
        self._epoch.record_step(self._last_delta, self._last_scaled)
        return loss

    def _gated_factors(self) -> tuple[list[torch.Tensor], torch.Tensor | list[torch.Tensor]]:
        """The parameters this step scales (those with a gradient) and their factors where the gate is open, else
        exactly 1, which leaves every value bit for bit as it was: branching on the gate would wait for the device on
        every step. Static mode's one factor is a float64 scalar, like the Python scalar it replaces, so float64
        gradients see the same factor. Tensor factors are gated together, one kernel for all (`_factor_stack`), not
        one a parameter: on a launch-bound GPU step every kernel counts (the H200's steady epochs with factors ran
        2.5 to 6 ms a step slower than first epochs without them, bench/data/gpu/whole_run)."""
        if self.mode == "static":
            factor = torch.where(self._last_scaled, torch.full_like(self._last_delta, self.static_scale), 1.0)
            return [p for p in self._kinds if p.grad is not None], factor
        if self._factor_stack is not None:
            factors = torch.where(self._last_scaled, self._factor_stack, 1.0).unbind()
        else:
            factors = [torch.where(self._last_scaled, s, 1.0) for s in self._gradscale.values()]
        scaled = [(p, factor) for p, factor in zip(self._gradscale, factors) if p.grad is not None]
        return [p for p, _ in scaled], [factor for _, factor in scaled]

    def _scaled_update_step(self, params: list[torch.Tensor], factors: torch.Tensor | list[torch.Tensor]) -> None:
        """The inner (AdamW) step with each scaled parameter's update times its factor s, its decay left alone.

        AdamW moves p to p_after = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps); this makes it
        p_after + (s - 1) (p_after - p (1 - lr wd)) from a copy of p taken before the step, so the moments are the
        plain step's own and s = 1 (a closed gate) changes nothing, bit for bit. One parameter-sized copy, five
        foreach kernels.
        """
        before = torch._foreach_mul(params, 1.0) if params else []  # a copy in one kernel
        self.optimizer.step()
        if not params:
            return
        keep = {p: 1 - group["lr"] * group["weight_decay"] for group in self.param_groups for p in group["params"]}
        torch._foreach_mul_(before, [keep[p] for p in params])  # the decayed p: p_after less the update
        torch._foreach_sub_(before, params)  # minus the update
        less_one = factors - 1 if isinstance(factors, torch.Tensor) else torch._foreach_sub(factors, 1.0)
        torch._foreach_mul_(before, less_one)
        torch._foreach_sub_(params, before)

    def _set_gradscale(self, gradscale: dict[torch.Tensor, torch.Tensor]) -> None:
        """The factors by parameter, and tensor factors (one number each) stacked in their order (`_gated_factors`)."""
        self._gradscale = gradscale
        tensor = gradscale and all(s.dim() == 0 for s in gradscale.values())
        self._factor_stack = torch.stack(list(gradscale.values())) if tensor else None

    def needs_update(self) -> bool:
        """Whether the caller should run :meth:`update_gradscale` on the current batch.

        Every ``update_every_steps`` steps, or (default) once after each epoch,
        an epoch being closed by :meth:`pop_epoch_metrics`. Always False in
        static mode. Check it after ``backward()`` and before ``step()``.
        """
        if self.mode == "static":
            return False
        if self.update_every_steps is None:
            return self._update_due
        return self._steps_since_update >= self.update_every_steps

    def update_gradscale(
        self,
        model: nn.Module,
        loss_of: Callable,
        batch,
        loss_scale: float = 1.0,
    ) -> None:
        """Re-estimate the factors from a sub-batch of the current large batch.

        Call after ``backward()`` on ``batch`` (a pair or a dict of tensors),
        this rank's local share of the large batch, and before ``step()``, so
        both gradients are taken at the same weights. ``loss_of(model, batch)``
        (tasks.Task.loss_of) returns (mean loss, count): the loss must be a
        mean (Eq. 7a), otherwise the ratio measures batch size instead of noise.

        The sub-batch gradient must not be synchronised: a DDP ``model`` is
        unwrapped and its plain module is differentiated with
        ``torch.autograd.grad``, so no collective runs, no buffer is
        broadcast and no ``.grad`` changes. BatchNorm statistics and the RNG
        are restored too, so profiling never perturbs the trajectory. With
        ``torch.distributed`` initialised each rank clamps its own ratios and
        the factors are then averaged over ``process_group``: every rank ends
        with identical factors, and the mean of independent B_small samples is
        a lower-variance estimate without shrinking the reference batch
        (averaging the gradients instead would measure a batch of
        world * B_small). The cost is one sub-batch forward/backward and one
        all-reduce of a gradient-sized (element) or tiny (tensor) buffer.

        Under fp16 autocast the caller passes its GradScaler's scale as
        ``loss_scale``: the sub-batch loss is multiplied by it, as the step's
        was, so its small gradients do not underflow, and the gradients are
        divided by it, so the factors compare unscaled gradients with the
        (already unscaled) ``.grad``.
        """
        self._check_update(batch_size(batch))
        params = self._profiled_params()
        module = model.module if isinstance(model, DistributedDataParallel) else model
        idx = self.reference_indices(batch_size(batch))
        small = self._small_batch_grads(module, loss_of, select(batch, idx), params, loss_scale)
        self._set_factors(small, params)

    def reference_indices(self, local_batch: int) -> torch.Tensor:
        """The reference sub-batch's positions in a local batch of this size (from the checkpointed sampler)."""
        return torch.randperm(local_batch, generator=self._generator)[: self.small_batch_size]

    def update_gradscale_from(self, small_grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """Re-estimate the factors from reference gradients the caller already has.

        The training loop gets them for free by making the reference sub-batch (positions from
        :meth:`reference_indices`) the first, unsynchronised micro-batch of the step's gradient
        accumulation: ``small_grads`` maps each parameter that micro-batch reached to its mean-loss
        gradient, and ``.grad`` holds the whole step's, already all-reduced. Same comparison as
        :meth:`update_gradscale` with no extra forward/backward; BatchNorm normalises the two
        micro-batches separately in that one step.
        """
        self._check_update(self.small_batch_size)
        params = self._profiled_params()
        small = [small_grads[p] if p in small_grads else torch.zeros_like(p) for p in params]
        self._set_factors(small, params)

    def _check_update(self, local_batch: int) -> None:
        if self.mode != "adaptive":
            raise RuntimeError("static mode uses the fixed static_scale; there is nothing to profile")
        if local_batch < self.small_batch_size:
            raise ValueError(
                f"local batch of {local_batch} samples cannot hold a reference sub-batch of {self.small_batch_size}"
            )

    def _profiled_params(self) -> list[torch.Tensor]:
        params = [p for p in self._kinds if p.requires_grad and p.grad is not None]
        if not params:
            raise RuntimeError(
                "the factors compare against the large-batch .grad of the scaled parameters: update after backward(), "
                "with at least one parameter kind not excluded"
            )
        return params

    def _set_factors(self, small: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.granularity in ("group", "model"):
                scales = self._shared_ratios(small, params)
            else:
                scales = [self._ratio(g_small, p.grad) for g_small, p in zip(small, params)]
            self._average_across_ranks(scales)
        self._set_gradscale({**self._gradscale, **dict(zip(params, scales))})
        self._updates += 1
        self._epoch.updates += 1
        self._steps_since_update = 0
        self._update_due = False

    def _small_batch_grads(
        self,
        module: nn.Module,
        loss_of: Callable,
        reference: Any,
        params: list[torch.Tensor],
        loss_scale: float,
    ) -> list[torch.Tensor]:
        buffers = list(module.buffers())
        saved = [b.detach().clone() for b in buffers]
        cuda = sorted({p.device.index for p in params if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            loss = loss_of(module, reference)[0]
            grads = torch.autograd.grad(loss * loss_scale, params, allow_unused=True)
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
        # A parameter the sub-batch does not reach has a zero small-batch gradient;
        # keeping it in the list keeps the all-reduce layout identical on all ranks.
        return [torch.zeros_like(p) if g is None else g.div_(loss_scale) for g, p in zip(grads, params)]

    def _ratio(self, g_small: torch.Tensor, g_large: torch.Tensor) -> torch.Tensor:
        if self.granularity == "element":
            ratio = (g_small.float() / (g_large.float() + self.eps)).abs()
        else:
            ratio = torch.linalg.vector_norm(g_small, dtype=torch.float32) / (
                torch.linalg.vector_norm(g_large, dtype=torch.float32) + self.eps
            )
        return self._clamped(ratio)

    def _shared_ratios(self, small: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ratio of norms per parameter kind ("group") or for all scaled parameters ("model"), each parameter
        given its share's: |g_small| / |g_large| over the share's tensors together."""
        shares = [self._kinds[p] if self.granularity == "group" else "model" for p in params]
        order = {share: i for i, share in enumerate(dict.fromkeys(shares))}
        index = torch.tensor([order[share] for share in shares], device=params[0].device)

        def squared_norms(grads: list[torch.Tensor]) -> torch.Tensor:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            return torch.zeros(len(order), device=norms.device).index_add_(0, index, norms.square())

        ratios = squared_norms(small).sqrt() / (squared_norms([p.grad for p in params]).sqrt() + self.eps)
        return list(self._clamped(ratios)[index].unbind())

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        # 0/0 carries no information about the noise level: stay neutral.
        return torch.nan_to_num(ratio, nan=1.0).clamp_(self.s_min, self.s_max)

    def _average_across_ranks(self, scales: list[torch.Tensor]) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size(self.process_group)
        if world == 1:
            return
        device = scales[0].device
        flat = torch.cat([s.reshape(-1).to(device) for s in scales])
        dist.all_reduce(flat, group=self.process_group)
        # Re-clamp: the rounded mean of in-range values may step one ulp outside.
        flat.div_(world).clamp_(self.s_min, self.s_max)
        chunks = flat.split([s.numel() for s in scales])
        for i, (s, chunk) in enumerate(zip(scales, chunks)):
            scales[i] = chunk.view_as(s).to(s.device)

    def pop_epoch_metrics(self) -> dict[str, Any]:
        """Close the epoch: return its JSON-serialisable metrics and reset them.

        Closing the epoch is also what makes an epoch-cadence update due.
        ``delta`` summarises the finite Deltas (None if there were none);
        ``scale_hist`` counts parameter entries per factor bin (a tensor-level
        factor counts once per element it scales, entries never profiled count
        as 1) and is None in static mode, where ``scaled_fraction`` alone is
        the Fig. 7 density.
        """
        epoch = self._epoch.values()
        scaled_steps = sum(epoch["gates"])
        self._scaled_steps += scaled_steps
        finite = [d for d in epoch["deltas"] if math.isfinite(d)]
        metrics = {
            "steps": epoch["steps"],
            "scaled_steps": scaled_steps,
            "scaled_fraction": scaled_steps / epoch["steps"] if epoch["steps"] else 0.0,
            "gradscale_updates": epoch["updates"],
            "nonfinite_delta_steps": len(epoch["deltas"]) - len(finite),
            "delta": {
                "min": min(finite),
                "median": statistics.median(finite),
                "max": max(finite),
                "mean": statistics.fmean(finite),
            }
            if finite
            else None,
            "scale_hist": self._scale_histogram() if self.mode == "adaptive" else None,
        }
        self._epoch = EpochLog()
        if self.mode == "adaptive" and self.update_every_steps is None:
            self._update_due = True
        return metrics

    def _scale_histogram(self) -> dict[str, list]:
        edges = torch.logspace(math.log10(self.s_min), math.log10(self.s_max), self.hist_bins + 1, dtype=torch.float64)
        low, width = math.log(self.s_min), (math.log(self.s_max) - math.log(self.s_min)) / self.hist_bins
        counts = torch.zeros(self.hist_bins, dtype=torch.int64)
        for p in self._params():
            scale = self._gradscale.get(p)
            values = torch.ones(1) if scale is None else scale.detach().reshape(-1).cpu()
            # Equal bins in log space (the edges above); clamping the bin index keeps float32
            # rounding at either end of the closed range [s_min, s_max] inside the histogram.
            if width > 0:
                bins = values.log().sub_(low).div_(width).floor_().clamp_(0, self.hist_bins - 1).long()
            else:
                bins = torch.zeros(values.numel(), dtype=torch.int64)
            counts += torch.bincount(bins, minlength=self.hist_bins) * (p.numel() // values.numel())
        return {"edges": edges.tolist(), "counts": counts.tolist()}

    def state_dict(self) -> dict[str, Any]:
        """The inner optimiser's state dict plus AGS state under ``"tula"``."""
        state = self.optimizer.state_dict()
        index = {p: i for i, p in enumerate(self._params())}
        state["tula"] = {
            "gradscale": {index[p]: s for p, s in self._gradscale.items() if p in index},
            "generator": self._generator.get_state(),
            "steps": self._steps,
            "scaled_steps": self._scaled_steps,
            "updates": self._updates,
            "steps_since_update": self._steps_since_update,
            "update_due": self._update_due,
            "last_sq_norm": None if self._last_sq_norm is None else self._last_sq_norm.item(),
            "last_delta": self.last_delta,
            "last_scaled": self.last_scaled,
            "epoch": self._epoch.values(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        if "tula" not in state_dict:
            raise ValueError("not a TulaOptimizer state dict (no 'tula' entry)")
        tula = state_dict.pop("tula")
        self.optimizer.load_state_dict(state_dict)
        self._share_inner()
        params = self._params()
        self._set_gradscale({params[i]: s.to(params[i].device) for i, s in tula["gradscale"].items()})
        self._generator.set_state(tula["generator"])
        self._steps = tula["steps"]
        self._scaled_steps = tula["scaled_steps"]
        self._updates = tula["updates"]
        self._steps_since_update = tula["steps_since_update"]
        self._update_due = tula["update_due"]
        device = params[0].device
        last_sq_norm = tula["last_sq_norm"]
        self._last_sq_norm = (
            None if last_sq_norm is None else torch.tensor(last_sq_norm, dtype=torch.float64, device=device)
        )
        self._last_delta = torch.tensor(tula["last_delta"], dtype=torch.float64, device=device)
        self._last_scaled = torch.tensor(tula["last_scaled"], device=device)
        self._epoch = EpochLog.from_values(tula["epoch"], device)
