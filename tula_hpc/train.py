"""Stage `train`: DDP training at the selected (nodes, global batch), checkpointed every epoch.

Read top to bottom: set-up, resume, the epoch loop, the final model. Checkpoints live in
work/{job}/train/ (never a declared output, so Snakemake never deletes them); only rank 0 writes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import launch, memory
from .checkpoint import load_checkpoint, restore_rng, save_checkpoint
from .data import load_splits, make_loader
from .distributed import Context, init_distributed, peer_failure, post_failure, seed_everything, shutdown
from .files import append_jsonl, atomic_path, read_json, write_json, write_jsonl
from .models import build_model
from .stage import StageError, stage_main
from .strategies import build_strategy


def make_optimizer(model: nn.Module, train_cfg: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        model.parameters(), lr=train_cfg["lr"], momentum=train_cfg["momentum"], weight_decay=train_cfg["weight_decay"]
    )


def build_for_job(job: dict, ctx: Context):
    """Data splits and the model on this rank's device, seeded so every rank starts identical."""
    seed_everything(job["train"]["seed"])
    splits = load_splits(job["data"], job["train"]["seed"])
    model = build_model(job["model"]["name"], splits.num_classes, splits.in_channels, job["data"]["image_size"])
    return splits, model.to(ctx.device)


def wrap_ddp(model: nn.Module, ctx: Context) -> nn.Module:
    if ctx.world_size == 1:
        return model
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def training_step(
    net: nn.Module, strategy, loss_fn, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1
) -> torch.Tensor:
    """One optimiser step on the batch (x, y); returns the batch's mean loss.

    With micro_batches > 1 the gradient is accumulated over that many slices of the batch, each loss
    weighted by its share: the same step (up to BatchNorm's per-slice statistics) with the activations
    of one slice, which is how training survives running out of memory without changing the global
    batch. Under DDP only the last slice synchronises. When the strategy asks for a reference
    sub-batch (AGS), it is accumulated first, and its own gradient is read off before the rest adds to it.
    """
    strategy.optimizer.zero_grad(set_to_none=True)
    reference = strategy.reference_indices(len(y))
    head, (x_main, y_main) = [], (x, y)
    if reference is not None:
        in_reference = torch.zeros(len(y), dtype=torch.bool)
        in_reference[reference] = True
        in_reference = in_reference.to(x.device)
        head, (x_main, y_main) = [(x[in_reference], y[in_reference])], (x[~in_reference], y[~in_reference])
    slices = head + [
        (xs, ys) for xs, ys in zip(x_main.tensor_split(micro_batches), y_main.tensor_split(micro_batches)) if len(ys)
    ]
    losses, reference_grads = [], None
    for i, (xs, ys) in enumerate(slices):
        last = i == len(slices) - 1
        with contextlib.nullcontext() if last or not isinstance(net, DDP) else net.no_sync():
            loss = loss_fn(net(xs), ys)
            if len(slices) > 1:
                loss = loss * (len(ys) / len(y))
            loss.backward()
        losses.append(loss.detach())
        if reference is not None and i == 0:
            share = len(y) / len(ys)
            reference_grads = {p: p.grad * share for p in net.parameters() if p.grad is not None}
    strategy.before_step(net, loss_fn, x, y, reference_grads)
    strategy.optimizer.step()
    strategy.after_step()
    return sum(losses[1:], losses[0])


def evaluate_accuracy(model: nn.Module, dataset, ctx: Context, batch_size: int = 256) -> float:
    """Top-1 accuracy over the whole data set, each rank scoring its shard."""
    loader = make_loader(dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, seed=0, shuffle=False)
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(ctx.device)).argmax(1)
            counts += torch.tensor(
                [(pred == y.to(ctx.device)).sum().item(), len(y)], dtype=torch.float64, device=ctx.device
            )
    model.train()
    if ctx.world_size > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def _fingerprint(job: dict, global_batch: int) -> dict:
    """What a checkpoint must match to be resumed: anything else means a different run."""
    return {"model": job["model"], "data": job["data"], "train": job["train"], "global_batch": global_batch}


def train_worker(
    job: dict,
    global_batch: int,
    checkpoint_path: str,
    model_path: str,
    metrics_path: str,
    accumulation: int = 1,
    selected_batch: int | None = None,
    failure_dir: str | None = None,
) -> dict | None:
    """One training attempt on every rank, with the device limited to resources.device_memory_gb.

    `accumulation` splits each device's batch into that many slices; `selected_batch` is the selected
    global batch, which names the run's checkpoint (default: global_batch). If any rank runs out of
    memory, every rank ends the attempt and returns {"outcome": "out_of_memory", "rank", "error"}
    instead of the summary (its peers learn of it through `failure_dir`); the checkpoint stays.
    """
    try:
        return _train_attempt(
            job, global_batch, checkpoint_path, model_path, metrics_path, accumulation, selected_batch or global_batch
        )
    except Exception as err:
        rank = int(os.environ.get("RANK", "0"))
        if memory.is_out_of_memory(err):
            note = {"outcome": "out_of_memory", "rank": rank, "error": str(err)[:500]}
            if failure_dir:
                post_failure(failure_dir, rank, note)
            return note
        note = peer_failure(failure_dir) if failure_dir and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
        if note is None:
            raise
        return note
    finally:
        memory.device_memory.lift()


def _train_attempt(
    job: dict,
    global_batch: int,
    checkpoint_path: str,
    model_path: str,
    metrics_path: str,
    accumulation: int,
    selected_batch: int,
) -> dict | None:
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
    per_device = global_batch // ctx.world_size
    splits, model = build_for_job(job, ctx)
    memory.device_memory.limit(ctx.device, memory.budget_bytes(job), memory.model_bytes(model), job)
    net = wrap_ddp(model, ctx)
    steps_per_epoch = math.ceil(math.ceil(len(splits.train) / ctx.world_size) / per_device)
    # The strategy (train.strategy) owns the optimiser, the per-step LR schedule and the hooks below.
    strategy = build_strategy(net, job["train"], global_batch, steps_per_epoch)
    optimizer, scheduler = strategy.optimizer, strategy.scheduler
    fingerprint = _fingerprint(job, selected_batch)

    start_epoch, step, train_time, resumed_from, restarts, history = 0, 0, 0.0, None, [], []
    checkpoint = load_checkpoint(Path(checkpoint_path))
    if checkpoint is not None and checkpoint["config"] == fingerprint:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        restore_rng(checkpoint["rng"])
        start_epoch, step = checkpoint["epoch"], checkpoint["step"]
        train_time = checkpoint["extra"]["train_time_s"]
        resumed_from = start_epoch
        restarts = checkpoint["extra"]["restarts"] + [start_epoch]
        history = checkpoint["extra"]["history"]
        if ctx.is_main:
            print(f"[train] resuming from checkpoint {checkpoint_path} at epoch {start_epoch}", flush=True)
    elif ctx.is_main and checkpoint is not None:
        print(f"[train] ignoring checkpoint {checkpoint_path}: it belongs to a different configuration", flush=True)
    if ctx.is_main:
        # The checkpoint's history is the truth: a kill between checkpoint and log line must not lose an epoch.
        write_jsonl(metrics_path, history)
    del checkpoint  # restored (the optimiser shares its state tensors): the rest must not hold device memory

    micro_batch = math.ceil(per_device / accumulation)
    loader = make_loader(
        splits.train,
        per_device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=job["train"]["seed"],
        shuffle=True,
        num_workers=job["data"]["num_workers"],
    )
    loss_fn = nn.CrossEntropyLoss()
    epochs = job["train"]["epochs"]
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        started = time.perf_counter()
        for x, y in loader:
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            loss = training_step(net, strategy, loss_fn, x, y, accumulation)
            step += 1
        strategy_metrics = strategy.end_epoch()
        epoch_time = time.perf_counter() - started
        train_time += epoch_time
        val_accuracy = evaluate_accuracy(net, splits.val, ctx, batch_size=micro_batch)
        record = {
            "epoch": epoch + 1,
            "step": step,
            "loss": float(loss),
            "val_accuracy": val_accuracy,
            "epoch_time_s": epoch_time,
            "lr": scheduler.get_last_lr()[0],
            **strategy_metrics,
        }
        history.append(record)
        if ctx.is_main:
            save_checkpoint(
                Path(checkpoint_path),
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                epoch=epoch + 1,
                step=step,
                config=fingerprint,
                extra={"train_time_s": train_time, "restarts": restarts, "history": history},
            )
            append_jsonl(metrics_path, record)
            print(
                f"[train] epoch {epoch + 1}/{epochs} loss {float(loss):.4f} val_acc {val_accuracy:.4f} "
                f"time {epoch_time:.2f}s",
                flush=True,
            )

    summary = None
    if ctx.is_main:
        with atomic_path(model_path) as tmp:
            torch.save(
                {
                    "model": model.state_dict(),
                    "model_name": job["model"]["name"],
                    "num_classes": splits.num_classes,
                    "in_channels": splits.in_channels,
                    "image_size": job["data"]["image_size"],
                },
                tmp,
            )
        summary = {
            "nodes": None,
            "global_batch": global_batch,
            "per_device_batch": per_device,
            "world_size": ctx.world_size,
            "accumulation": accumulation,
            "micro_batch": micro_batch,
            "epochs": epochs,
            "steps": step,
            "steps_per_epoch": steps_per_epoch,
            "strategy": strategy.name,
            "train_samples": len(splits.train),
            "train_time_s": train_time,
            "resumed_from_epoch": resumed_from,
            "restarts_at_epochs": restarts,
            "history": history,
        }
    shutdown()
    return summary


def after_out_of_memory(on_oom: str, global_batch: int, accumulation: int, world_size: int) -> tuple[int, int] | None:
    """The next attempt's (global batch, accumulation) after running out of memory; None once one sample failed.

    keep_global_batch halves the slice each device computes at once and doubles the accumulation, so the
    selected configuration (global batch, steps, gradient statistics) stays; shrink_global_batch halves
    the global batch instead, as the paper does.
    """
    per_device = global_batch // world_size
    if math.ceil(per_device / accumulation) <= 1:
        return None
    if on_oom == "keep_global_batch":
        return global_batch, accumulation * 2
    return per_device // 2 * world_size, accumulation


def _next_attempt(job: dict, chosen: dict, attempts: list[dict], world_size: int) -> tuple[int, int]:
    """(global batch, accumulation) of the next attempt; a failed attempt is rerun, an out-of-memory one shrunk."""
    if not attempts:
        return chosen["batch"], 1
    last = attempts[-1]
    if last["outcome"] != "out_of_memory":
        attempts.pop()
        return last["global_batch"], last["accumulation"]
    shrunk = after_out_of_memory(job["resources"]["on_oom"], last["global_batch"], last["accumulation"], world_size)
    if shrunk is None:
        raise StageError(
            f"job '{job['name']}': training ran out of memory even with {last['micro_batch']} sample per device "
            f"at once ({len(attempts)} attempts): field 'resources.device_memory_gb' "
            f"({job['resources']['device_memory_gb']} GB) "
            f"cannot train {job['model']['name']} with strategy {job['train']['strategy']}; last error: {last['error']}"
        )
    return shrunk


def train(job: dict, selection_path: Path, out_dir: Path, work_dir: Path) -> dict:
    """Train the selected configuration, relaunched with smaller slices while it runs out of memory.

    Every attempt is recorded in work/{job}/train/attempts.json (so a restarted stage goes on from the
    last one) and in train/summary.json; each resumes from the checkpoint of the last finished epoch.
    """
    chosen = read_json(selection_path)["chosen"]
    stage_dir = Path(work_dir) / "train"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = launch.LaunchSpec.for_job(job, nodes=chosen["nodes"])
    started = time.time()
    log_path, selected = stage_dir / "attempts.json", {"nodes": chosen["nodes"], "batch": chosen["batch"]}
    log = read_json(log_path) if log_path.exists() else {}
    attempts = log["attempts"] if log.get("selected") == selected else []
    while True:
        global_batch, accumulation = _next_attempt(job, chosen, attempts, spec.world_size)
        per_device = global_batch // spec.world_size
        attempt = {
            "global_batch": global_batch,
            "per_device_batch": per_device,
            "accumulation": accumulation,
            "micro_batch": math.ceil(per_device / accumulation),
            "outcome": "running",
        }
        attempts.append(attempt)
        write_json(log_path, {"selected": selected, "attempts": attempts})
        result = launch.run(
            train_worker,
            dict(
                job=job,
                global_batch=global_batch,
                checkpoint_path=str(stage_dir / "checkpoint.pt"),
                model_path=str(out_dir / "model.pt"),
                metrics_path=str(stage_dir / "metrics.jsonl"),
                accumulation=accumulation,
                selected_batch=chosen["batch"],
                failure_dir=str(stage_dir / "failures" / uuid.uuid4().hex[:12]),
            ),
            spec,
            stage_dir,
            name=f"{job['name']}-train",
        )
        attempt.update(
            outcome=result.get("outcome", "completed"), **{k: result[k] for k in ("rank", "error") if k in result}
        )
        write_json(log_path, {"selected": selected, "attempts": attempts})
        if attempt["outcome"] == "completed":
            break
        print(
            f"[train] out of memory on rank {attempt['rank']} at {attempt['micro_batch']} samples per device at once",
            flush=True,
        )
    summary = {**result, "nodes": chosen["nodes"], "wall_time_s": time.time() - started, "attempts": attempts}
    write_json(out_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--selection", required=True, type=Path, help="selection.json from the select stage")
        parser.add_argument("--out-dir", required=True, type=Path, help="results/{job}/train")

    return stage_main(
        "train", add_args, lambda job, args: train(job, args.selection, args.out_dir, args.work_dir), argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
