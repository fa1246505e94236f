"""The optimisers a strategy steps with, and the one place that builds them from a job: SGD, LARS for the lars recipe
(train.strategy lars, or train.ags.base lars), AdamW (train.optimizer adamw) and LAMB (the lars recipe under adamw). A
new optimiser is a class here, or torch's, chosen in `build_optimizer`; its rate rule (scaling, warm-up) is
lr_schedule.py's, what a strategy does around it strategies.py's. Gradient clipping by global norm (train.grad_clip) is
here too, and the kinds of parameter (embeddings, norms, biases, attention, weights) that weight decay and AGS's
exclusions read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tula_hpc.core.job import recipe

if TYPE_CHECKING:
    from tula_hpc.core.job import TrainSettings


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
        loss = _loss_of(closure)
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


class LAMB(torch.optim.Optimizer):
    """LARS's Adam counterpart, LAMB (You et al., "Large Batch Optimization for Deep Learning", ICLR 2020), with the
    identity as its scaling function phi.

    Per parameter tensor: Adam's moments m, v with bias correction, u = m_hat / (sqrt(v_hat) + eps) + wd * w, and
    w -= lr * (|w| / |u|) * u, the trust ratio 1 where either norm is 0. Groups with ``adapt=False`` (biases,
    normalisation layers, embeddings) take torch's AdamW step, u's ratio left out. The state (step, exp_avg,
    exp_avg_sq) is named as torch's Adam names it, so Adam's noise-scale preconditioner reads either.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=True))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _loss_of(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the host, as torch's AdamW keeps it: no device sync
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                steps = float(state["step"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / (1 - beta2**steps)).sqrt_().add_(group["eps"])
                update = (state["exp_avg"] / (1 - beta1**steps)).div_(denominator).add_(p, alpha=group["weight_decay"])
                if group["adapt"]:
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                    update.mul_(ratio)
                p.add_(update, alpha=-group["lr"])
        return loss


def _loss_of(closure: Callable[[], Any] | None) -> Any:
    """The closure's loss, evaluated with gradients on before a step, as torch's optimisers do; None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# The kinds of parameter `parameter_kinds` tells apart (train.ags.exclude names some of them; the schema's enum).
PARAMETER_KINDS = ("embeddings", "norms", "biases", "attention", "weights")
# The kinds AGS and static scaling leave alone when train.ags.exclude is null, by optimiser: under AdamW the
# parameters whose gradients are sparse (embeddings) or small and sensitive (norms, biases), the same ones AdamW leaves
# undecayed; under SGD none, the paper's.
UNSCALED_BY_DEFAULT = {"adamw": ("embeddings", "norms", "biases"), "sgd": ()}
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)  # _NormBase: batch and instance norms


def parameter_kinds(net: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of `net` (once, however many modules share it) by kind (PARAMETER_KINDS): embeddings
    (nn.Embedding weights, also where tied to an output layer), norms (normalisation layers' parameters), biases (the
    other parameters of fewer than two dimensions), attention (the weights of an nn.MultiheadAttention or of a module
    whose qualified name holds "attn" or "attention"), weights (the rest). The one place that tells them apart:
    weight decay (decay_groups) and AGS's exclusions and groups (train.ags) read it."""
    embeddings = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)}
    norms = {id(p) for m in net.modules() if isinstance(m, NORMS) for p in m.parameters()}
    attention = {
        id(p)
        for name, m in net.named_modules()
        if isinstance(m, nn.MultiheadAttention) or "attn" in name.lower() or "attention" in name.lower()
        for p in m.parameters()
    }
    kinds = {}
    for p in net.parameters():
        if id(p) in embeddings:
            kinds[p] = "embeddings"
        elif p.ndim < 2:
            kinds[p] = "norms" if id(p) in norms else "biases"
        else:
            kinds[p] = "attention" if id(p) in attention else "weights"
    return kinds


def decay_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """`net`'s parameters in two groups: weight decay on the weights of two or more dimensions (linear and conv
    weights, attention's too), none on biases, normalisation layers and embeddings (parameter_kinds), as nanoGPT's
    configure_optimizers and minGPT's rule. A tied parameter is listed once."""
    kinds = parameter_kinds(net)
    decayed = [p for p, kind in kinds.items() if kind in ("attention", "weights")]
    others = [p for p, kind in kinds.items() if kind not in ("attention", "weights")]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]


def build_optimizer(net: nn.Module, train_cfg: TrainSettings, lr: float) -> torch.optim.Optimizer:
    """The optimiser of train_cfg's recipe over `net`'s parameters at peak rate `lr` (train.momentum,
    train.weight_decay; under adamw train.betas, train.eps and decay_groups).

    LARS adapts the rate of weight tensors only: biases and normalisation layers (one dimension) take plain SGD steps;
    LAMB (lars under adamw) the decayed weights only: biases, norms and embeddings take AdamW's steps.
    """
    params = list(net.parameters())
    if train_cfg.optimizer == "adamw":
        groups = decay_groups(net, train_cfg.weight_decay)
        adam = dict(lr=lr, betas=tuple(train_cfg.betas), eps=train_cfg.eps)
        if recipe(train_cfg) == "lars":
            decayed, others = groups
            return LAMB([decayed, {**others, "adapt": False}], **adam)
        return torch.optim.AdamW(groups, **adam)
    sgd = dict(lr=lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay)
    if recipe(train_cfg) == "lars":
        layers = [p for p in params if p.ndim > 1]
        others = [p for p in params if p.ndim <= 1]
        return LARS(
            [{"params": layers}, {"params": others, "adapt": False}],
            **sgd,
            trust_coefficient=train_cfg.lars.trust_coefficient,
        )
    return torch.optim.SGD(params, **sgd)


def clip_gradients(params, max_norm: float | None) -> None:
    """Clip the gradients of `params` to global L2 norm `max_norm` (train.grad_clip; None: leave them): after fp16's
    unscale, so that the norm is the true gradient's."""
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


# Adam's per-parameter state that a change of batch may zero (train.adam_moments_on_batch_change reset)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def reset_moments(optimizer: torch.optim.Optimizer) -> None:
    """Zero Adam's moments and step count in place, as AdaptDL does at each change of batch: the moments measured at
    the old batch's noise no longer describe the new one's, and bias correction starts again from the next step."""
    for state in optimizer.state.values():
        for key in ADAM_MOMENTS:
            if isinstance(state.get(key), torch.Tensor):
                state[key].zero_()
            elif key in state:
                state[key] = 0
