"""Stage `train`: DDP training at the selected (nodes, global batch), checkpointed every epoch and at the
step where a signal asks the job to stop (preemption.py).

Read top to bottom: set-up, resume (mid-epoch too), the epoch loop, the final model. The step itself and its set-up are
training.py's, shared with profiling and memory probing. Checkpoints live in work/{job}/train/ (never a
declared output, so Snakemake never deletes them); only rank 0 writes.

Time. `train_time_s` is the time of the epochs the final model went through (steps and data loading,
not validation or checkpoints): what the performance model predicts. Epochs or parts of epochs that a
kill, a preemption or running out of memory threw away are lost work; `train_time_with_lost_work_s`
adds them, from a log rank 0 appends to every LOOP_LOG_EVERY_S seconds of the loop and on its way out.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from . import launch
from .budget import budget_bytes, budget_source, device_memory, is_out_of_memory, model_bytes
from .checkpoint import load_checkpoint, restore_rng, save_checkpoint
from .config import stage_settings
from .data import loader_options, make_loader, start_epoch
from .distributed import end_job_step, failure_records, init_distributed, shutdown
from .files import append_jsonl, atomic_path, read_json, read_jsonl, write_json, write_jsonl
from .layout import steps_per_epoch as epoch_steps
from .preemption import StopRequests
from .stage import StageError, stage_main
from .strategies import build_strategy
from .training import build_for_job, evaluate_accuracy, loop_step, wrap_ddp

LOOP_LOG_EVERY_S = 10.0


class LoopClock:
    """Seconds this process spent in the epoch loop, appended to a log that survives the process.

    Each process is one session; the loop time of all sessions together, kept or lost, is what the
    run cost (`loop_time_s`).
    """

    def __init__(self, path: Path | None):
        self.path, self.session, self.spent, self.logged = path, uuid.uuid4().hex[:12], 0.0, 0.0

    def add(self, seconds: float, force: bool = False) -> None:
        self.spent += seconds
        if self.path is not None and (force or self.spent - self.logged >= LOOP_LOG_EVERY_S):
            append_jsonl(self.path, {"session": self.session, "loop_s": self.spent})
            self.logged = self.spent


def loop_time_s(path: Path) -> float:
    """Loop seconds of every session in the log (each session's last entry is its total)."""
    if not Path(path).exists():
        return 0.0
    return sum({r["session"]: r["loop_s"] for r in read_jsonl(path)}.values())


def train_worker(
    job: dict,
    global_batch: int,
    checkpoint_path: str,
    model_path: str,
    metrics_path: str,
    accumulation: int = 1,
    selected_batch: int | None = None,
    failure_dir: str | None = None,
    loop_log_path: str | None = None,
) -> dict | None:
    """One training attempt on every rank, with the device limited to resources.device_memory_gb.

    `accumulation` splits each device's batch into that many slices; `selected_batch` is the selected
    global batch, which names the run's checkpoint (default: global_batch). A rank that runs out of
    memory records it in `failure_dir` and ends the whole job step (`end_job_step`); the checkpoint stays.
    Without `failure_dir` (called in-process) the error is raised instead.
    """
    try:
        return _train_attempt(
            job,
            global_batch,
            checkpoint_path,
            model_path,
            metrics_path,
            accumulation,
            selected_batch or global_batch,
            Path(loop_log_path) if loop_log_path else None,
        )
    except Exception as err:
        if failure_dir and is_out_of_memory(err):
            note = {"outcome": "out_of_memory", "error": str(err)[:500]}
            end_job_step(failure_dir, int(os.environ.get("RANK", "0")), note)
        raise
    finally:
        device_memory.lift()


def _train_attempt(
    job: dict,
    global_batch: int,
    checkpoint_path: str,
    model_path: str,
    metrics_path: str,
    accumulation: int,
    selected_batch: int,
    loop_log_path: Path | None,
) -> dict | None:
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
    per_device = global_batch // ctx.world_size
    splits, model = build_for_job(job, ctx)
    device_memory.limit(ctx.device, budget_bytes(job, ctx.device), model_bytes(model), job)
    net = wrap_ddp(model, ctx)
    steps_per_epoch = epoch_steps(len(splits.train), ctx.world_size, per_device)
    # The strategy (train.strategy) owns the optimiser, the per-step LR schedule and the hooks below.
    strategy = build_strategy(net, job["train"], global_batch, steps_per_epoch)
    run = {**stage_settings(job, "train"), "selected_batch": selected_batch}  # what a resumable checkpoint matches

    epoch, samples_done, step, train_time, open_epoch_time = 0, 0, 0, 0.0, 0.0
    resumed_from, restarts, history = None, [], []
    checkpoint = load_checkpoint(Path(checkpoint_path))
    if checkpoint is not None and checkpoint["config"] == run:
        model.load_state_dict(checkpoint["model"])
        epoch, samples_done = checkpoint["epoch"], checkpoint["samples_in_epoch"]
        # The schedule is this attempt's own, at its own step count for the work done (see Strategy.resume):
        # a relaunch at a smaller global batch counts the samples done in its own, smaller steps.
        step = epoch * steps_per_epoch + math.ceil(samples_done / per_device)
        strategy.resume(checkpoint["optimizer"], step)
        restore_rng(checkpoint["rng"])
        train_time, open_epoch_time = checkpoint["extra"]["train_time_s"], checkpoint["extra"]["open_epoch_time_s"]
        resumed_from = {"epoch": epoch, "step": step}
        restarts = checkpoint["extra"]["restarts"] + [step]
        history = checkpoint["extra"]["history"]
        if ctx.is_main:
            print(
                f"[train] resuming from checkpoint {checkpoint_path} at epoch {epoch} "
                f"({samples_done} samples per rank into it), step {step}",
                flush=True,
            )
    elif ctx.is_main and checkpoint is not None:
        print(f"[train] ignoring checkpoint {checkpoint_path}: it belongs to a different configuration", flush=True)
    if ctx.is_main:
        # The checkpoint's history is the truth: a kill between checkpoint and log line must not lose an epoch.
        write_jsonl(metrics_path, history)
        if resumed_from is None and loop_log_path is not None:
            write_jsonl(loop_log_path, [])  # a fresh run: earlier runs' loop time is not this run's
    del checkpoint  # restored (the optimiser shares its state tensors): the rest must not hold device memory

    micro_batch = math.ceil(per_device / accumulation)
    options = loader_options(job, ctx.device)
    loader = make_loader(
        splits.train,
        per_device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=job["train"]["seed"],
        shuffle=True,
        **options,
    )
    loss_fn = nn.CrossEntropyLoss()
    epochs = job["train"]["epochs"]
    clock = LoopClock(loop_log_path if ctx.is_main else None)

    def save(samples_in_epoch: int, epoch_time: float) -> None:
        save_checkpoint(
            Path(checkpoint_path),
            model=model,
            optimizer=strategy.optimizer,
            epoch=epoch,
            step=step,
            config=run,
            samples_in_epoch=samples_in_epoch,
            extra={
                "train_time_s": train_time,
                "open_epoch_time_s": epoch_time,
                "restarts": restarts,
                "history": history,
            },
        )

    with StopRequests(ctx.world_size) as stop:
        while epoch < epochs:
            start_epoch(loader, epoch, samples_done)
            batches_done = math.ceil(samples_done / per_device)
            spent_before, started, stopping = clock.spent - open_epoch_time, time.perf_counter(), False
            try:
                for batch in loader:
                    loss, stopping = loop_step(net, strategy, loss_fn, batch, ctx.device, stop, accumulation)
                    step, batches_done = step + 1, batches_done + 1
                    now = time.perf_counter()
                    clock.add(now - started)
                    started = now
                    # Asked to stop mid-epoch: save this step; after the epoch's last one, its own checkpoint does.
                    if stopping and batches_done < steps_per_epoch:
                        clock.add(0.0, force=True)
                        if ctx.is_main:
                            save(batches_done * per_device, clock.spent - spent_before)
                        stop.leave(ctx.rank)
            finally:  # running out of memory mid-epoch: the time spent so far is lost work, logged on the way out
                clock.add(time.perf_counter() - started, force=True)
            strategy_metrics = strategy.end_epoch()
            epoch_time = clock.spent - spent_before
            train_time += epoch_time
            epoch, samples_done, open_epoch_time = epoch + 1, 0, 0.0
            val_accuracy = evaluate_accuracy(net, splits.val, ctx, batch_size=micro_batch, **options)
            record = {
                "epoch": epoch,
                "step": step,
                "loss": float(loss),
                "val_accuracy": val_accuracy,
                "epoch_time_s": epoch_time,
                "lr": strategy.scheduler.get_last_lr()[0],
                **strategy_metrics,
            }
            history.append(record)
            if ctx.is_main:
                save(0, 0.0)
                append_jsonl(metrics_path, record)
                print(
                    f"[train] epoch {epoch}/{epochs} loss {float(loss):.4f} val_acc {val_accuracy:.4f} "
                    f"time {epoch_time:.2f}s",
                    flush=True,
                )
            if stopping and epoch < epochs:
                stop.leave(ctx.rank)

    summary = None
    if ctx.is_main:
        with atomic_path(model_path) as tmp:
            torch.save(
                {
                    "model": model.state_dict(),
                    "model_name": job["model"]["name"],
                    "model_kwargs": job["model"]["kwargs"],
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
            "resumed_from_epoch": None if resumed_from is None else resumed_from["epoch"],
            "resumed_from_step": None if resumed_from is None else resumed_from["step"],
            "restarts_at_steps": restarts,
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
            f"({budget_source(job)}) "
            f"cannot train {job['model']['name']} with strategy {job['train']['strategy']}; last error: {last['error']}"
        )
    return shrunk


def train(job: dict, selection_path: Path, summary_path: Path, model_path: Path, work_dir: Path) -> dict:
    """Train the selected configuration, relaunched with smaller slices while it runs out of memory.

    Every attempt is recorded in work/{job}/train/attempts.json (so a restarted stage goes on from the
    last one) and in train/summary.json; each resumes from the checkpoint of the last finished epoch.
    """
    chosen = read_json(selection_path)["chosen"]
    stage_dir = Path(work_dir) / "train"
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
        failure_dir = stage_dir / "failures" / uuid.uuid4().hex[:12]
        try:
            result = launch.run(
                train_worker,
                dict(
                    job=job,
                    global_batch=global_batch,
                    checkpoint_path=str(stage_dir / "checkpoint.pt"),
                    model_path=str(Path(model_path).resolve()),
                    metrics_path=str(stage_dir / "metrics.jsonl"),
                    accumulation=accumulation,
                    selected_batch=chosen["batch"],
                    failure_dir=str(failure_dir),
                    loop_log_path=str(stage_dir / "loop_time.jsonl"),
                ),
                spec,
                stage_dir,
                name=f"{job['name']}-train",
            )
        except launch.JobFailed:
            # A rank that ran out of memory recorded it and ended the job step; anything else is a failure.
            result = next((r for r in failure_records(failure_dir) if r["outcome"] == "out_of_memory"), None)
            if result is None:
                raise
            result["noticed_after_s"] = round(time.time() - result.pop("recorded_at"), 1)
        attempt.update(
            outcome=result.get("outcome", "completed"),
            **{k: result[k] for k in ("rank", "error", "noticed_after_s") if k in result},
        )
        write_json(log_path, {"selected": selected, "attempts": attempts})
        if attempt["outcome"] == "completed":
            break
        print(
            f"[train] out of memory on rank {attempt['rank']} at {attempt['micro_batch']} samples per device at once; "
            f"(recorded {attempt['noticed_after_s']} s before the job's end was known here)",
            flush=True,
        )
    summary = {
        **result,
        "nodes": chosen["nodes"],
        "train_time_with_lost_work_s": loop_time_s(stage_dir / "loop_time.jsonl"),
        "wall_time_s": time.time() - started,
        "attempts": attempts,
    }
    write_json(summary_path, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--selection", required=True, type=Path, help="selection.json from the select stage")
        parser.add_argument("--summary", required=True, type=Path, help="results/{job}/train/summary.json")
        parser.add_argument("--model", required=True, type=Path, help="results/{job}/train/model.pt")

    def run(job: dict, args: argparse.Namespace) -> dict:
        return train(job, args.selection, args.summary, args.model, args.work_dir)

    return stage_main("train", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
