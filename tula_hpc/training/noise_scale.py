"""The gradient noise scale B_noise = tr(Sigma) / |G|^2 (McCandlish et al., "An Empirical Model of Large-Batch
Training", 2018), measured where DDP already holds the gradients of two batch sizes.

A mini-batch gradient of B samples has E|g_B|^2 = |G|^2 + tr(Sigma) / B. Under DDP each rank's bucket before the
all-reduce is its own batch b's gradient and after it the mean over the N ranks, batch N x b; two sizes give the
unbiased estimates (appendix A of the paper)

    |G|^2    ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)

Each is noisy (either can come out negative on one step), so they are smoothed apart, numerator and denominator
each in its own exponential moving average, and divided only when read, as the paper advises.

`NoiseScaleHook` is a DDP comm hook: it reads each bucket's squared norm before and after the one all-reduce DDP
does anyway (no second collective of the model, no extra forward or backward pass), keeps the sums on the device
and folds them into the averages at `end_step` with device arithmetic only (no host synchronisation per step).
Each rank's |g_small|^2 is its own sample; `read` averages the ranks' estimates with one all-reduce of two scalars,
which an epoch's end or a profile's end can afford.

Under Adam the step is the gradient preconditioned by P = diag(1 / (sqrt(v_hat) + eps)), so the noise that matters is
the preconditioned gradient's: B_noise = tr(P Sigma P) / |P G|^2, measured as above on |P g|^2 (AdaptDL's Adam
gradient noise scale, petuum/adaptdl adaptdl/torch/gradient_noise_scale.py; the maths is McCandlish's with P applied,
P being linear and the same on every rank). `AdamPreconditioner` reads P from the current optimiser's exp_avg_sq with
its bias correction; until the optimiser has stepped there is no v, and those steps add no estimate (AdaptDL uses the
plain gradient then: |g|^2 and |P g|^2 differ by orders of magnitude, and one moving average would mix the two).

What a noise scale means for the steps a batch needs (AdaScale's gain, the recipe's progress) is
progress.py's, which imports no torch: the stages that only plan, fit and choose run on a login node.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Weight of a step's estimate in the moving averages: about the last 1/(1 - SMOOTHING) = 100 steps.
SMOOTHING = 0.99


def two_batch_estimates(small_sq, big_sq, small_batch: float, big_batch: float):
    """(|G|^2, tr(Sigma)) from squared norms of gradients of `small_batch` and `big_batch` samples."""
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small batch < big batch, got {small_batch} and {big_batch}")
    gradient_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace = (small_sq - big_sq) / (1 / small_batch - 1 / big_batch)
    return gradient_sq, trace


class NoiseScale:
    """Moving averages of |G|^2 and tr(Sigma), kept as device tensors; the noise scale is their ratio.

    `update` takes one step's squared norms (tensors or floats) at two batch sizes; `value` reads the ratio (and
    synchronises with the device, so call it at an epoch's end, not per step). Bias-corrected like Adam's moments,
    so the first steps are not pulled toward zero.
    """

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        self.smoothing = smoothing
        self.steps = 0
        self.gradient_sq = torch.zeros((), dtype=torch.float64)
        self.trace = torch.zeros((), dtype=torch.float64)

    def update(self, small_sq, big_sq, small_batch: float, big_batch: float) -> None:
        gradient_sq, trace = two_batch_estimates(small_sq, big_sq, small_batch, big_batch)
        gradient_sq = torch.as_tensor(gradient_sq, dtype=torch.float64)
        trace = torch.as_tensor(trace, dtype=torch.float64)
        self.gradient_sq = self.gradient_sq.to(gradient_sq.device) * self.smoothing + (1 - self.smoothing) * gradient_sq
        self.trace = self.trace.to(trace.device) * self.smoothing + (1 - self.smoothing) * trace
        self.steps += 1

    def averages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bias-corrected (|G|^2, tr(Sigma)) as device tensors."""
        correction = 1 - self.smoothing**self.steps if self.steps else 1.0
        return self.gradient_sq / correction, self.trace / correction

    def value(self) -> dict | None:
        """B_noise and its two averages, as floats; None before any step."""
        if not self.steps:
            return None
        gradient_sq, trace = (float(v) for v in self.averages())
        return describe(gradient_sq, trace, self.steps)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "gradient_sq": float(self.gradient_sq), "trace": float(self.trace)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.gradient_sq = torch.tensor(state["gradient_sq"], dtype=torch.float64)
        self.trace = torch.tensor(state["trace"], dtype=torch.float64)


def describe(gradient_sq: float, trace: float, steps: int, tokens_per_sample: int = 1, preconditioner=None) -> dict:
    """The record a profile or an epoch keeps: B_noise (in samples) is undefined while |G|^2 is not positive. A run of
    sequences (`tokens_per_sample` > 1, data.seq_len) also gets it in tokens, as GPT-3's batches are counted; a
    preconditioned measurement names its preconditioner."""
    b_noise = trace / gradient_sq if gradient_sq > 0 else None
    record = {"b_noise": b_noise, "gradient_sq": gradient_sq, "trace_sigma": trace, "steps": steps}
    if tokens_per_sample > 1:
        record["b_noise_tokens"] = None if b_noise is None else b_noise * tokens_per_sample
    if preconditioner is not None:
        record["preconditioner"] = preconditioner.name
    return record


class AdamPreconditioner:
    """Adam's diagonal preconditioner 1 / (sqrt(v_hat) + eps), v_hat = exp_avg_sq / (1 - beta2 ** step), read from
    `optimizer`'s state when called (AdamW, LAMB, or TulaOptimizer around either): the v its next step divides by."""

    name = "adam"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group = {p: group for group in optimizer.param_groups for p in group["params"]}

    def denominators(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """sqrt(v_hat) + eps per parameter of `params`; None while any has no v yet (before the first step, or
        after moments reset at a change of batch)."""
        denominators = []
        for p in params:
            state = self.optimizer.state.get(p, {})
            steps = float(state.get("step", 0))  # a host tensor in torch's AdamW and LAMB: no device sync
            if not steps:
                return None
            group = self._group[p]
            correction = 1 - group["betas"][1] ** steps
            denominators.append((state["exp_avg_sq"] / correction).sqrt_().add_(group["eps"]))
        return denominators


def preconditioner_for(optimizer: torch.optim.Optimizer, kind: str) -> AdamPreconditioner | None:
    """The preconditioner the noise scale measures under train.optimizer `kind`: Adam's, or none (SGD's step is the
    gradient itself)."""
    return AdamPreconditioner(optimizer) if kind == "adamw" else None


class NoiseScaleHook:
    """DDP's gradient all-reduce as a comm hook that also measures the noise scale (see the module's docstring).

    `attach(ddp)` registers it; call `end_step(local_batch, loss_scale)` after each
    optimiser step's backward (DDP has waited for every bucket by then). Steps whose backward ran without syncing
    (DDP's no_sync, accumulation's earlier micro-batches) add nothing. `preconditioner` (settable: a strategy built
    at a new batch hands the hook its own optimiser) is None for SGD's plain gradient or an `AdamPreconditioner`.
    """

    def __init__(
        self, world_size: int, smoothing: float = SMOOTHING, preconditioner=None, tokens_per_sample: int = 1
    ) -> None:
        if world_size < 2:
            raise ValueError("the noise scale from DDP's buckets needs at least 2 ranks")
        self.world_size = world_size
        self.estimate = NoiseScale(smoothing)
        self.preconditioner: AdamPreconditioner | None = preconditioner
        self.tokens_per_sample = tokens_per_sample
        self._small: torch.Tensor | None = None
        self._big: torch.Tensor | None = None
        self._synced = False
        self._unconditioned = False  # a bucket of this step found no v to precondition with

    def attach(self, ddp) -> None:
        """DDP's gradient all-reduce becomes this one (a DDP model takes one comm hook: polo's excludes it)."""
        ddp.register_comm_hook(self, _measured_all_reduce)

    def on_bucket(self, bucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        if self._small is None:
            self._small = torch.zeros((), dtype=torch.float64, device=buffer.device)
            self._big = torch.zeros((), dtype=torch.float64, device=buffer.device)
        self._synced = True
        denominators = None
        if self.preconditioner is not None:
            denominators = self.preconditioner.denominators(bucket.parameters())
            self._unconditioned |= denominators is None
        self._small.add_(_squared_norm(buffer, bucket, denominators))
        buffer.div_(self.world_size)
        work = dist.all_reduce(buffer, async_op=True)

        def reduced(future: torch.futures.Future) -> torch.Tensor:
            mean = future.value()[0]  # the bucket's buffer, reduced in place: its gradients() views hold the mean
            self._big.add_(_squared_norm(mean, bucket, denominators))
            return mean

        return work.get_future().then(reduced)

    def end_step(self, local_batch: int, loss_scale=1.0) -> None:
        """Fold this step's bucket sums into the averages; `loss_scale` (a float or a device tensor, read without
        synchronising) is the factor fp16 gradients carry.

        `local_batch` counts samples (images, windows), not what the loss averages (a causal LM's tokens): samples
        are the independent draws the two-batch estimate assumes (a window's tokens are not), the count is known
        without a host sync, and the noise scale is read against batches chosen in samples."""
        if not self._synced:
            return
        if not self._unconditioned:
            unscale = 1.0 / torch.as_tensor(loss_scale, dtype=torch.float64, device=self._small.device) ** 2
            small, big = self._small * unscale, self._big * unscale
            self.estimate.update(small, big, local_batch, local_batch * self.world_size)
        self._small.zero_()
        self._big.zero_()
        self._synced = self._unconditioned = False

    def read(self) -> dict | None:
        """The ranks' averages combined (one all-reduce of two scalars; every rank must call it)."""
        if not self.estimate.steps:
            return None
        gradient_sq, trace = self.estimate.averages()
        both = torch.stack([gradient_sq, trace]).to(self._small.device)
        dist.all_reduce(both)
        both /= self.world_size
        gradient_sq, trace = float(both[0]), float(both[1])
        return describe(gradient_sq, trace, self.estimate.steps, self.tokens_per_sample, self.preconditioner)


def _squared_norm(buffer: torch.Tensor, bucket, denominators: list[torch.Tensor] | None) -> torch.Tensor:
    """|g|^2 of a bucket's flat gradient `buffer`, or |P g|^2 over its per-parameter views (bucket.gradients(), which
    share `buffer`'s memory) divided by `denominators`; float64 on the buffer's device."""
    if denominators is None:
        return torch.linalg.vector_norm(buffer, dtype=torch.float32).double().square()
    norms = [torch.linalg.vector_norm(g / d, dtype=torch.float32) for g, d in zip(bucket.gradients(), denominators)]
    return torch.stack(norms).double().square().sum()


def _measured_all_reduce(state, bucket):
    """The comm hook DDP calls per bucket (a plain function: DDP reads its name and signature)."""
    return state.on_bucket(bucket)
