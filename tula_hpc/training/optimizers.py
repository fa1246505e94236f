"""The optimisers a strategy steps with, and the one place that builds them from a job: SGD, LARS for the lars
recipe (train.strategy lars, or train.ags.base lars), and AdamW (train.optimizer adamw). A new optimiser (LAMB) is a
class here, or torch's, chosen in `build_optimizer`; its rate rule (scaling, warm-up) is lr_schedule.py's, what a
strategy does around it strategies.py's. Gradient clipping by global norm (train.grad_clip) is here too.
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


def decay_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """`net`'s parameters in two groups: weight decay on the weights of two or more dimensions (linear and conv
    weights), none on biases, normalisation layers and embeddings (nn.Embedding's, also where tied to an output
    layer), as nanoGPT's configure_optimizers and minGPT's rule. A tied parameter is listed once."""
    embeddings = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)}
    decayed, others = [], []
    for p in net.parameters():  # each tensor once, however many modules share it
        (decayed if p.ndim >= 2 and id(p) not in embeddings else others).append(p)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]


def build_optimizer(net: nn.Module, train_cfg: TrainSettings, lr: float) -> torch.optim.Optimizer:
    """The optimiser of train_cfg's recipe over `net`'s parameters at peak rate `lr` (train.momentum,
    train.weight_decay; under adamw train.betas, train.eps and decay_groups).

    LARS adapts the rate of weight tensors only: biases and normalisation layers (one dimension) take plain SGD steps.
    """
    params = list(net.parameters())
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            decay_groups(net, train_cfg.weight_decay),
            lr=lr,
            betas=tuple(train_cfg.betas),
            eps=train_cfg.eps,
        )
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
