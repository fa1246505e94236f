"""Stage `profile`: a few real DDP training steps at one (nodes, global batch), timed part by part.

Odd steps are ordinary DDP steps (gradient sync overlapped with backward): their time is the step
time training will see. Even steps split the same work into data loading, forward+backward without
sync (`no_sync`), an explicit all-reduce of the flattened gradients, and the optimiser update, so the
performance model can fit compute and sync separately. Per-step times are the maximum over ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import launch
from .data import make_loader
from .distributed import init_distributed, shutdown
from .files import read_json, write_json
from .stage import StageError, stage_main
from .train import build_for_job, make_optimizer, wrap_ddp

PARTS = ("data_s", "compute_s", "sync_s", "update_s", "step_s")


def _batches(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield from loader


def _all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def profile_worker(job: dict, global_batch: int, warmup_steps: int, steps: int) -> dict | None:
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
    per_device = global_batch // ctx.world_size
    splits, model = build_for_job(job, ctx)
    net = wrap_ddp(model, ctx)
    optimizer = make_optimizer(model, job["train"])
    loss_fn = nn.CrossEntropyLoss()
    batches = _batches(make_loader(splits.train, per_device, rank=ctx.rank, world_size=ctx.world_size,
                                   seed=job["train"]["seed"], shuffle=True, drop_last=True,
                                   num_workers=job["data"]["num_workers"]))
    no_sync = net.no_sync if ctx.world_size > 1 else contextlib.nullcontext
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def split_step() -> list[float]:
        t0 = time.perf_counter()
        x, y = (t.to(ctx.device) for t in next(batches))
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with no_sync():
            loss_fn(net(x), y).backward()
        sync()
        t2 = time.perf_counter()
        if ctx.world_size > 1:
            dist.barrier()  # stragglers wait here, not inside the timed all-reduce
            t_sync0 = time.perf_counter()
            _all_reduce_gradients(model, ctx.world_size)
            sync()
            sync_s = time.perf_counter() - t_sync0
        else:
            sync_s = 0.0
        t3 = time.perf_counter()
        optimizer.step()
        sync()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, sync_s, t4 - t3]

    def full_step() -> float:
        t0 = time.perf_counter()
        x, y = (t.to(ctx.device) for t in next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        optimizer.step()
        sync()
        return time.perf_counter() - t0

    for _ in range(warmup_steps):
        full_step()
    rows = []
    for _ in range(steps):
        rows.append(split_step() + [full_step()])
    times = torch.tensor(rows, dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    peak = torch.tensor([_peak_rss_bytes()], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    shutdown()
    if not ctx.is_main:
        return None
    columns = {part: times[:, i].tolist() for i, part in enumerate(PARTS)}
    medians = {part: statistics.median(values) for part, values in columns.items()}
    spread = {part: (statistics.quantiles(v, n=4)[2] - statistics.quantiles(v, n=4)[0]) / medians[part] if medians[part] > 0 else 0.0
              for part, v in columns.items()}
    return {
        "world_size": ctx.world_size, "per_device_batch": per_device, "global_batch": global_batch,
        "warmup_steps": warmup_steps, "steps": steps, "median": medians, "iqr_over_median": spread,
        "per_step": columns, "samples_per_s": global_batch / medians["step_s"], "peak_rss_bytes": int(peak.item()),
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def profile(job: dict, plan_path: Path, nodes: int, batch: int, out: Path, work_dir: Path) -> dict:
    planned = read_json(plan_path)["profile"]
    if not any(c["nodes"] == nodes and c["batch"] == batch for c in planned):
        raise StageError(f"job '{job['name']}': (nodes={nodes}, batch={batch}) is not in the plan {plan_path}")
    spec = launch.LaunchSpec.for_job(job, nodes=nodes)
    search = job["search"]
    result = launch.run(profile_worker, dict(job=job, global_batch=batch, warmup_steps=search["warmup_steps"],
                                             steps=search["steps"]),
                        spec, Path(work_dir) / "profile" / f"N{nodes}_B{batch}", name=f"{job['name']}-profile-N{nodes}-B{batch}")
    result.update(nodes=nodes, launcher=spec.launcher)
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, type=Path, help="plan.json from the plan stage")
        parser.add_argument("--nodes", required=True, type=int)
        parser.add_argument("--batch", required=True, type=int, help="global batch")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/profile/N{n}_B{b}.json")

    return stage_main("profile", add_args,
                      lambda job, args: profile(job, args.plan, args.nodes, args.batch, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
