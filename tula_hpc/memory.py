"""Stage `probe_memory`: measure real training steps at a few small batches, fit the linear memory model
(paper Eq. 3: M = M_param + M_grad + M_opt + M_act(b) + M_batch(b)) and derive the largest per-device batch.

Each probe batch runs in a fresh process (allocator state and lazily built kernels of one probe must not
leak into the next). The measured quantity is the peak resident memory of one training step above the
process baseline: VmHWM is reset through /proc/self/clear_refs just before the step and glibc is told
to return freed blocks at once (MALLOC_MMAP_THRESHOLD_), so resident memory follows live tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression

from . import launch
from .files import write_json
from .stage import StageError, stage_main

PROBE_BATCHES = (16, 32, 64)
MMAP_THRESHOLD = "131072"
GB = 1e9


class LinearMemoryModel(BaseEstimator, RegressorMixin):
    """Peak step memory above the baseline as intercept + slope * per-device batch (bytes)."""

    def fit(self, batches, peak_bytes) -> "LinearMemoryModel":
        regression = LinearRegression().fit(np.asarray(batches, float).reshape(-1, 1), np.asarray(peak_bytes, float))
        self.intercept_ = float(regression.intercept_)
        self.slope_ = float(regression.coef_[0])
        return self

    def predict(self, batches) -> np.ndarray:
        return self.intercept_ + self.slope_ * np.asarray(batches, float).reshape(-1)

    def max_batch(self, available_bytes: float) -> int:
        """Largest batch whose predicted peak fits in `available_bytes` (0 if none does)."""
        if self.slope_ <= 0:
            raise ValueError("memory does not grow with the batch: the probes are too noisy to extrapolate")
        return max(0, int((available_bytes - self.intercept_) // self.slope_))


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measure_step(job: dict, batch: int) -> dict:
    """One real training step at `batch`, in this (fresh) process: components and measured peak, bytes."""
    import torch
    from torch import nn

    from .distributed import Context
    from .train import build_for_job, make_optimizer

    torch.set_num_threads(1)
    ctx = Context(0, 1, 0, torch.device("cpu"))
    splits, model = build_for_job(job, ctx)
    optimizer = make_optimizer(model, job["train"])
    loss_fn = nn.CrossEntropyLoss()
    samples = [splits.train[i % len(splits.train)] for i in range(batch)]

    def step(x, y, saved=None):
        optimizer.zero_grad(set_to_none=True)
        if saved is None:
            loss_fn(model(x), y).backward()
        else:
            with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
                loss = loss_fn(model(x), y)
            loss.backward()
        optimizer.step()

    # Warm-up at batch 1 builds kernels and thread pools once; then forget grads and optimiser state so
    # the measured step allocates them as the first training step does.
    step(samples[0][0].unsqueeze(0), torch.tensor([samples[0][1]]))
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            activations[storage.data_ptr()] = storage.nbytes()
        return tensor

    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    x = torch.stack([s[0] for s in samples])
    y = torch.tensor([int(s[1]) for s in samples])
    batch_bytes = x.nbytes + y.nbytes
    step(x, y, keep)
    peak = (_status_kib("VmHWM") - baseline) * 1024
    params = list(model.parameters())
    return {
        "batch": batch,
        "measured_peak_bytes": peak,
        "param_bytes": sum(p.nbytes for p in params),
        "grad_bytes": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer_bytes": sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
        "activation_bytes": sum(activations.values()),
        "batch_bytes": batch_bytes,
        "loader_prefetch_bytes": batch_bytes * 2 * job["data"]["num_workers"],
    }


def _probe_in_fresh_process(job: dict, batch: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tula_hpc.memory", "--measure", json.dumps(job), str(batch)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe at batch {batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe_worker(job: dict, probe_batches: tuple[int, ...]) -> dict:
    from .data import load_splits

    probes = [_probe_in_fresh_process(job, b) for b in probe_batches]
    splits = load_splits(job["data"], job["train"]["seed"])
    return {"probes": probes, "dataset": {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)}}


def summarise(job: dict, measured: dict) -> dict:
    """Fit the line and size the largest batch; refuse budgets the model alone does not fit in."""
    probes = measured["probes"]
    model = LinearMemoryModel().fit([p["batch"] for p in probes], [p["measured_peak_bytes"] for p in probes])
    res = job["resources"]
    budget = res["device_memory_gb"] * GB
    usable = budget * (1 - res["memory_headroom"])
    param_bytes = probes[0]["param_bytes"]
    max_batch = model.max_batch(usable - param_bytes)
    if max_batch < 1:
        needed = param_bytes + model.predict([1])[0]
        raise StageError(
            f"job '{job['name']}': field 'resources.device_memory_gb': {res['device_memory_gb']} GB "
            f"({usable:.0f} bytes after {res['memory_headroom']:.0%} headroom) cannot hold even batch 1 of "
            f"{job['model']['name']}: it needs {needed:.0f} bytes ({needed / GB:.3f} GB)")
    return {
        "job": job["name"],
        "probes": probes,
        "fit": {"intercept_bytes": model.intercept_, "slope_bytes_per_sample": model.slope_},
        "param_bytes": param_bytes,
        "device_memory_bytes": budget,
        "headroom": res["memory_headroom"],
        "max_batch_per_device": max_batch,
        "dataset": measured["dataset"],
    }


def probe_memory(job: dict, out: Path, work_dir: Path, probe_batches: tuple[int, ...] = PROBE_BATCHES) -> dict:
    spec = launch.LaunchSpec.for_job(job, nodes=1)
    spec = launch.LaunchSpec(**{**spec.__dict__, "gpus_per_node": min(spec.gpus_per_node, 1)})
    measured = launch.run(probe_worker, dict(job=job, probe_batches=probe_batches), spec, Path(work_dir) / "probe_memory",
                          name=f"{job['name']}-probe-memory")
    result = summarise(job, measured)
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:
        print(json.dumps(measure_step(json.loads(argv[1]), int(argv[2]))))
        return 0

    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/memory.json")

    return stage_main("probe-memory", add_args, lambda job, args: probe_memory(job, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
