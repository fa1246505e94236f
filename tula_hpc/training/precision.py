"""Mixed precision as a job setting (train.precision, train.channels_last): autocast, fp16's loss scaling and the
memory format, held by every strategy (strategies.py) so that training, profiling and memory probing step alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

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

    def inputs(self, batch):
        """A batch (a tensor, a pair or a dict of tensors) with its images in the model's memory format: a no-op
        for other tensors and for images already in it."""
        if not self.channels_last:
            return batch
        return tree_map(lambda t: t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t, batch)

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
