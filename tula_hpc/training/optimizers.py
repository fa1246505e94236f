"""The optimisers a strategy steps with, and the one place that builds them from a job: SGD, and LARS for the lars
recipe (train.strategy lars, or train.ags.base lars). A new optimiser (AdamW, LAMB) is a class here, or torch's,
chosen in `build_optimizer`; its rate rule (scaling, warm-up) is lr_schedule.py's, what a strategy does around it
strategies.py's.
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


def build_optimizer(params: list[nn.Parameter], train_cfg: TrainSettings, lr: float) -> torch.optim.Optimizer:
    """The optimiser of train_cfg's recipe over `params` at peak rate `lr` (train.momentum, train.weight_decay).

    LARS adapts the rate of weight tensors only: biases and normalisation layers (one dimension) take plain SGD steps.
    """
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
