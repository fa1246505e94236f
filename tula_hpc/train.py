"""Stage `train`: DDP training at the selected (nodes, global batch), checkpointed every epoch.

Read top to bottom: set-up, resume, the epoch loop, the final model. Checkpoints live in
work/{job}/train/ (never a declared output, so Snakemake never deletes them); only rank 0 writes.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import launch
from .checkpoint import load_checkpoint, restore_rng, save_checkpoint
from .data import load_splits, make_loader
from .distributed import Context, init_distributed, seed_everything, shutdown
from .files import append_jsonl, atomic_path, read_json, read_jsonl, write_json
from .models import build_model
from .stage import stage_main


def make_optimizer(model: nn.Module, train_cfg: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=train_cfg["lr"], momentum=train_cfg["momentum"],
                           weight_decay=train_cfg["weight_decay"])


def make_scheduler(optimizer: torch.optim.Optimizer, train_cfg: dict):
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=train_cfg["lr_milestones"], gamma=train_cfg["lr_gamma"])


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


def evaluate_accuracy(model: nn.Module, dataset, ctx: Context, batch_size: int = 256) -> float:
    """Top-1 accuracy over the whole data set, each rank scoring its shard."""
    loader = make_loader(dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, seed=0, shuffle=False)
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(ctx.device)).argmax(1)
            counts += torch.tensor([(pred == y.to(ctx.device)).sum().item(), len(y)], dtype=torch.float64, device=ctx.device)
    model.train()
    if ctx.world_size > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def _fingerprint(job: dict, global_batch: int) -> dict:
    """What a checkpoint must match to be resumed: anything else means a different run."""
    return {"model": job["model"], "data": job["data"], "train": job["train"], "global_batch": global_batch}


def train_worker(job: dict, global_batch: int, checkpoint_path: str, model_path: str, metrics_path: str) -> dict | None:
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
    per_device = global_batch // ctx.world_size
    splits, model = build_for_job(job, ctx)
    net = wrap_ddp(model, ctx)
    optimizer = make_optimizer(model, job["train"])
    scheduler = make_scheduler(optimizer, job["train"])
    fingerprint = _fingerprint(job, global_batch)

    start_epoch, step, train_time, resumed_from, restarts = 0, 0, 0.0, None, []
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
        if ctx.is_main:
            print(f"[train] resuming from checkpoint {checkpoint_path} at epoch {start_epoch}", flush=True)
    elif ctx.is_main:
        if checkpoint is not None:
            print(f"[train] ignoring checkpoint {checkpoint_path}: it belongs to a different configuration", flush=True)
        Path(metrics_path).unlink(missing_ok=True)

    loader = make_loader(splits.train, per_device, rank=ctx.rank, world_size=ctx.world_size, seed=job["train"]["seed"],
                         shuffle=True, num_workers=job["data"]["num_workers"])
    loss_fn = nn.CrossEntropyLoss()
    epochs = job["train"]["epochs"]
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        started = time.perf_counter()
        for x, y in loader:
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            optimizer.step()
            step += 1
        epoch_time = time.perf_counter() - started
        train_time += epoch_time
        scheduler.step()
        val_accuracy = evaluate_accuracy(net, splits.val, ctx)
        if ctx.is_main:
            save_checkpoint(Path(checkpoint_path), model=model, optimizer=optimizer, scheduler=scheduler, epoch=epoch + 1,
                            step=step, config=fingerprint, extra={"train_time_s": train_time, "restarts": restarts})
            record = {"epoch": epoch + 1, "step": step, "loss": float(loss), "val_accuracy": val_accuracy,
                      "epoch_time_s": epoch_time, "lr": scheduler.get_last_lr()[0]}
            append_jsonl(metrics_path, record)
            print(f"[train] epoch {epoch + 1}/{epochs} loss {float(loss):.4f} val_acc {val_accuracy:.4f} "
                  f"time {epoch_time:.2f}s", flush=True)

    summary = None
    if ctx.is_main:
        with atomic_path(model_path) as tmp:
            torch.save({"model": model.state_dict(), "model_name": job["model"]["name"], "num_classes": splits.num_classes,
                        "in_channels": splits.in_channels, "image_size": job["data"]["image_size"]}, tmp)
        summary = {
            "nodes": None, "global_batch": global_batch, "per_device_batch": per_device, "world_size": ctx.world_size,
            "epochs": epochs, "steps": step, "steps_per_epoch": math.ceil(math.ceil(len(splits.train) / ctx.world_size) / per_device),
            "train_samples": len(splits.train), "train_time_s": train_time, "resumed_from_epoch": resumed_from,
            "restarts_at_epochs": restarts,
            "history": list({r["epoch"]: r for r in read_jsonl(metrics_path)}.values()),
        }
    shutdown()
    return summary


def train(job: dict, selection_path: Path, out_dir: Path, work_dir: Path) -> dict:
    """Submit training on the selected configuration, wait, and write train/summary.json."""
    chosen = read_json(selection_path)["chosen"]
    stage_dir = Path(work_dir) / "train"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = launch.LaunchSpec.for_job(job, nodes=chosen["nodes"])
    started = time.time()
    summary = launch.run(
        train_worker,
        dict(job=job, global_batch=chosen["batch"], checkpoint_path=str(stage_dir / "checkpoint.pt"),
             model_path=str(out_dir / "model.pt"), metrics_path=str(stage_dir / "metrics.jsonl")),
        spec, stage_dir, name=f"{job['name']}-train",
    )
    summary.update(nodes=chosen["nodes"], wall_time_s=time.time() - started)
    write_json(out_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--selection", required=True, type=Path, help="selection.json from the select stage")
        parser.add_argument("--out-dir", required=True, type=Path, help="results/{job}/train")

    return stage_main("train", add_args, lambda job, args: train(job, args.selection, args.out_dir, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
