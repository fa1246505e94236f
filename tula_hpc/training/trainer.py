"""The training loop on every rank: DDP training at one global batch (or a schedule of them), checkpointed every
epoch, every resources.checkpoint_every_steps steps if set, and at the step where a signal asks the job to stop
(preemption.py): mid-epoch, or after an epoch's last step with its end (validation and all) left to the resumed run,
so a short grace time is spent on the save alone. Rank 0 times every save and keeps the longest, with the longest
step, beside the checkpoint (attempts.StopTimes), for the stage to size the next job's warning before its time limit.
The train stage (stages/train.py) launches `train_handed_off` (`train_worker` given the stage's TrainHandoff,
handoff.py) and relaunches it after running out of memory.

Read top to bottom: set-up, resume (mid-epoch too), the epoch loop, the final model. The step itself and its set-up
are step.py's, shared with profiling and memory probing. Checkpoints live in work/{job}/train/ (never a
declared output, so Snakemake never deletes them); only rank 0 writes, with every rank's RNG states, while
the others wait for it outside any collective (distributed.wait_for_main: a checkpoint may outlast the
collective timeout).

Time. `train_time_s` is the time of the epochs the final model went through (steps and data loading,
not validation or checkpoints): what the performance model predicts. On a GPU the steps are queued, not done,
when the loop goes on: the clock that closes an epoch or a mid-epoch save is read once the device is done
(step.clock_for), and at no other step, which would take away the overlap of host and device training has.
Each epoch's `data_wait_s` (metrics.jsonl) is the part of it the loop waited for its loader, to set beside the
profile's data part (which cannot overlap: profiling waits for every step). Epochs or parts of epochs that a
kill, a preemption or running out of memory threw away are lost work; `train_time_with_lost_work_s`
adds them, from a log rank 0 appends to as the loop goes and on its way out (loop_accounting.LoopClock).

The batch. Under train.batch_schedule adaptive or ramp it is chosen again during the run (`Trainer.next_batch`, by
performance/batch_schedule.py's BatchSchedule or BatchRamp): where the schedule says a decision falls (places in
samples trained, the same in a resumed run) and at every epoch's end. A change mid-epoch goes on at each rank's next
unseen sample of the epoch's permutation (`epoch_batches`). The rate schedule's place is the samples trained so far
in the new batch's steps, warm-up steps counted at the run's starting batch, so warm-up and decay lie over samples
(tokens); `state.step` is that place, `state.optimizer_steps` the steps taken. The checkpoint keeps the batch in
effect and the step it changed at, so a resume sets up at it.
"""

from __future__ import annotations

import math
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tula_hpc.cluster.distributed import init_distributed, mean_over_ranks, shutdown
from tula_hpc.cluster.job_step_failures import out_of_memory_ends_job_step
from tula_hpc.core.atomic_files import append_jsonl, write_jsonl
from tula_hpc.core.dependencies import stage_settings
from tula_hpc.core.run_layout import steps_per_epoch as epoch_steps
from tula_hpc.memory.device_budget import budget_bytes, device_memory, model_bytes
from tula_hpc.training.attempts import StopTimes
from tula_hpc.training.checkpoint import CHECKPOINT_FORMAT, Checkpointer, TrainState, own_rng_state, restore_rng
from tula_hpc.training.evaluation import save_trained_model
from tula_hpc.training.handoff import BatchChooser, TrainHandoff
from tula_hpc.training.loaders import loader_options, make_loader, start_epoch
from tula_hpc.training.loop_accounting import LoopClock, StepTrace, TimedBatches
from tula_hpc.training.optimizers import reset_moments
from tula_hpc.training.preemption import StopRequests
from tula_hpc.training.progress import run_epochs, tokens_per_sample, whole_epochs
from tula_hpc.training.step import build_for_job, clock_for, loop_step, wrap_ddp
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import job_task
from tula_hpc.training.validation import Validation, validation_due, validation_subset

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def accumulation_for(per_device_batch: int, micro_cap: int | None) -> int:
    """Slices a device's batch is computed in: 1, or enough that none is above `micro_cap` (after running out of
    memory)."""
    return 1 if micro_cap is None else max(1, math.ceil(per_device_batch / micro_cap))


def train_worker(
    job: Job,
    global_batch: int,
    checkpoint_path: str,
    model_path: str,
    metrics_path: str,
    accumulation: int = 1,
    selected_batch: int | None = None,
    failure_dir: str | None = None,
    loop_log_path: str | None = None,
    schedule: BatchChooser | None = None,
    micro_cap: int | None = None,
    stop_warning_s: int | None = None,
) -> dict | None:
    """One training attempt on every rank, with the device limited to resources.device_memory_gb.

    `accumulation` splits each device's batch into that many slices; `selected_batch` is the selected
    global batch, which names the run's checkpoint (default: global_batch). `schedule` (train.batch_schedule
    adaptive or ramp) re-chooses the batch during the run, each computed in slices of at most `micro_cap` samples (set
    after running out of memory). `stop_warning_s`: the warning before the time limit this job gets (None: none),
    which rank 0 holds against its first save. A rank that runs out of memory records it, with the batch and slice
    in effect, in `failure_dir` and ends the whole job step (`end_job_step`); the checkpoint stays.
    Without `failure_dir` (called in-process) the error is raised instead.
    """
    trainer = None
    try:
        with out_of_memory_ends_job_step(failure_dir, lambda: trainer.batch_in_effect() if trainer else {}):
            trainer = Trainer(
                job,
                global_batch,
                Path(checkpoint_path),
                Path(metrics_path),
                accumulation,
                selected_batch or global_batch,
                schedule,
                micro_cap,
                stop_warning_s,
            )
            summary = trainer.train(Path(model_path), Path(loop_log_path) if loop_log_path else None)
            shutdown()  # not on an error: a rank that fails ends the job step at once (end_job_step), peers and all
            return summary
    finally:
        device_memory.lift()


def train_handed_off(handoff: TrainHandoff, failure_dir: str | None = None) -> dict | None:
    """The train stage's worker: `train_worker` with what the stage handed off. A job pickled before the hand-off was
    typed names `train_worker` with these fields as keywords; it loads and runs as it did."""
    return train_worker(
        **{field.name: getattr(handoff, field.name) for field in fields(handoff)}, failure_dir=failure_dir
    )


class Trainer:
    """One training attempt on this rank: set up (model, strategy, loader, resumed from the checkpoint), then
    `train`, which hands each piece to a method: the epoch's steps, the epoch's end, the checkpoint, the summary."""

    def __init__(
        self,
        job: Job,
        global_batch: int,
        checkpoint_path: Path,
        metrics_path: Path,
        accumulation: int,
        selected_batch: int,
        schedule: BatchChooser | None = None,
        micro_cap: int | None = None,
        stop_warning_s: int | None = None,
    ):
        self.job, self.accumulation, self.schedule, self.micro_cap = job, accumulation, schedule, micro_cap
        self.stop_warning_s, self.step_s = stop_warning_s, 0.0
        self.checkpoint_path, self.metrics_path = checkpoint_path, metrics_path
        self.ctx = ctx = init_distributed(job.resources.gpus_per_node > 0)
        self.splits, self.model = build_for_job(job, ctx)
        self.tokens_per_sample = tokens_per_sample(job.data)
        device_memory.limit(ctx.device, budget_bytes(job, ctx.device), model_bytes(self.model), job)
        self.net = wrap_ddp(self.model, ctx)
        self.loader_options = loader_options(job, ctx.device)
        # What a resumable checkpoint matches: the settings, the selection, and the checkpoint's layout (an older
        # one is ignored with a line saying so, not misread).
        self.run = {
            **stage_settings(job.as_dict(), "train"),
            "selected_batch": selected_batch,
            "format": CHECKPOINT_FORMAT,
        }
        self.checkpointer = Checkpointer(checkpoint_path, self.run, ctx)
        self.state, self.strategy, self.batches = TrainState(), None, None
        checkpoint = self.checkpointer.load()
        if checkpoint is not None:
            self.state.load_state_dict(checkpoint["state"])
        # The run's length in samples and its starting batch (a ramp's first), whatever batch it is at now.
        samples = len(self.splits.train)
        self.run_samples = run_epochs(job.train, samples, global_batch, self.tokens_per_sample) * samples
        self.start_batch = schedule.start(global_batch) if schedule else global_batch
        self.use_batch(self.state.global_batch or self.start_batch)  # the schedule's batch, where it changed it
        self.resumed_from = self.resume(checkpoint)
        del checkpoint
        # The run's longest save and step: a resumed run goes on from its record, a fresh run measures afresh.
        self.stop_times = (StopTimes.read(checkpoint_path) if self.resumed_from else None) or StopTimes()
        self.first_save = True
        self.device_clock = clock_for(ctx.device)
        self.task = job_task(job)
        validation_set = validation_subset(self.splits.val, job.train.val_samples, job.train.seed)
        self.validation = Validation(self.net, validation_set, ctx, self.task, self.loader_options)
        self.epochs = self.state.epoch + self.strategy.epochs_left(self.run_epochs, self.state.epoch)

    def use_batch(self, global_batch: int) -> None:
        """Train at `global_batch` from here: its per-device batch and slices, steps per epoch, loader, and the
        strategy (train.strategy: the optimiser, the per-step LR schedule, the hooks around the step) built for it.

        A strategy built before (a change of batch) hands over the optimiser's state (Adam's moments zeroed under
        train.adam_moments_on_batch_change reset) and its own, placed at the samples trained so far in this batch's
        steps, as a resume from a checkpoint does; the noise scale hook and the epoch's data wait stay.
        """
        ctx, previous = self.ctx, self.strategy
        self.global_batch, self.per_device = global_batch, global_batch // ctx.world_size
        if self.schedule is not None:
            self.accumulation = accumulation_for(self.per_device, self.micro_cap)
        self.micro_batch = math.ceil(self.per_device / self.accumulation)
        self.steps_per_epoch = epoch_steps(len(self.splits.train), ctx.world_size, self.per_device)
        samples, tokens = len(self.splits.train), self.tokens_per_sample
        self.length = run_epochs(self.job.train, samples, global_batch, tokens)  # its last epoch may be part-run
        self.run_epochs = whole_epochs(self.length)
        self.strategy = build_strategy(
            self.net,
            self.train_settings(global_batch),
            global_batch,
            self.steps_per_epoch,
            samples,
            noise_scale=previous.noise_scale if previous is not None else None,
            tokens_per_sample=tokens,
        )
        if previous is not None:
            self.state.step = self.schedule_place()
            self.strategy.resume(previous.optimizer.state_dict(), self.state.step)
            self.strategy.load_state_dict(previous.state_dict())
            if self.job.train.optimizer == "adamw" and self.job.train.adam_moments_on_batch_change == "reset":
                reset_moments(self.strategy.optimizer)
            self.epochs = self.state.epoch + self.strategy.epochs_left(self.run_epochs, self.state.epoch)
        self.loader = make_loader(
            self.splits.train,
            self.per_device,
            rank=ctx.rank,
            world_size=ctx.world_size,
            seed=self.job.train.seed,
            shuffle=True,
            **self.loader_options,
        )
        waited = self.batches.waited if self.batches is not None else 0.0
        self.batches = TimedBatches(self.loader)
        self.batches.waited = waited

    def train_settings(self, global_batch: int):
        """train's settings at `global_batch`: the cosine warm-up's steps, counted at the run's starting batch, in
        this batch's steps, so that the warm-up covers the same samples whatever the batch."""
        train, schedule = self.job.train, self.job.train.lr_schedule
        if global_batch == self.start_batch or not schedule.warmup_steps:
            return train
        warmup = max(1, round(schedule.warmup_steps * self.start_batch / global_batch))
        return replace(train, lr_schedule=replace(schedule, warmup_steps=warmup))

    def schedule_place(self) -> int:
        """The rate schedule's place at the batch in effect: the epochs and samples trained so far in its steps."""
        return self.state.epoch * self.steps_per_epoch + math.ceil(self.state.samples_done / self.per_device)

    def samples_trained(self) -> int:
        """Samples trained so far over every rank (the sampler's padding of an epoch's last batches left out)."""
        state, samples = self.state, len(self.splits.train)
        return state.epoch * samples + min(state.samples_done * self.ctx.world_size, samples)

    def batch_in_effect(self) -> dict:
        """The batch and the slice a device computes at once, as an out-of-memory record keeps them."""
        return {"global_batch": self.global_batch, "accumulation": self.accumulation, "micro_batch": self.micro_batch}

    def train(self, model_path: Path, loop_log_path: Path | None) -> dict | None:
        """Every epoch left, each checkpointed; the final model and the summary (rank 0's; None elsewhere)."""
        ctx, state = self.ctx, self.state
        if ctx.is_main:
            # The checkpoint's history is the truth: a kill between checkpoint and log line must not lose an epoch.
            write_jsonl(self.metrics_path, state.history)
            if self.resumed_from is None and loop_log_path is not None:
                write_jsonl(loop_log_path, [])  # a fresh run: earlier runs' loop time is not this run's
        self.clock = LoopClock(loop_log_path if ctx.is_main else None)
        self.trace = StepTrace(ctx.is_main)
        with StopRequests(ctx.world_size) as stop:
            # An epoch whose steps a stop saved before its end (open_epoch_steps) still has that end to come.
            while state.epoch < self.epochs and (state.open_epoch_steps or not self.strategy.finished()):
                self.end_epoch(*self.run_epoch(stop))
        if not ctx.is_main:
            return None
        save_trained_model(model_path, self.model, self.job, self.splits)
        return self.summary()

    def run_epoch(self, stop) -> tuple[torch.Tensor, float]:
        """The open epoch's steps left: (this rank's mean loss over the epoch's steps, the epoch's time), the steps a
        save before this attempt kept included.

        Asked to stop, the step is saved at once, an epoch's last one too (its end, validation and all, is the
        resumed run's: a short grace time must not go on it), and this rank leaves. Every
        resources.checkpoint_every_steps steps (if set) it is saved mid-epoch too, after a change of batch the step
        made. The time of a step's work still queued on the device counts (`device.wait`).
        """
        state, clock = self.state, self.clock
        if state.step != self.schedule_place():  # the epoch before changed batch mid-way: its last step was short
            state.step = self.schedule_place()
            self.strategy.place(state.step)
        spent_before, started = clock.spent - state.open_epoch_time, time.perf_counter()
        self.batches.waited = state.open_epoch_data_wait
        # Summed on the device (no sync per step), from the saved steps' sum (every rank's mean).
        loss_sum, steps = torch.tensor(state.open_epoch_loss_sum, device=self.ctx.device), state.open_epoch_steps
        try:
            for batch in self.epoch_batches():
                trained_before = self.samples_trained()
                loss, stopping = loop_step(
                    self.net, self.strategy, self.task, batch, self.ctx.device, stop, self.accumulation
                )
                loss_sum, steps = loss_sum + loss.detach().float(), steps + 1
                state.samples_done = min(state.samples_done + self.per_device, self.loader.sampler.num_samples)
                state.step, state.optimizer_steps = state.step + 1, state.optimizer_steps + 1
                self.trace.add(state.optimizer_steps)
                epoch_over = state.samples_done >= self.loader.sampler.num_samples or self.strategy.finished()
                trained = self.samples_trained()
                places = (trained_before / self.run_samples, trained / self.run_samples)
                deciding = self.schedule is not None and not epoch_over and self.schedule.due(*places)
                saving = stopping or (self.checkpoint_due(state.optimizer_steps) and not epoch_over)
                tokens = (trained_before * self.tokens_per_sample, trained * self.tokens_per_sample)
                validating = validation_due(self.job.train, state.optimizer_steps, tokens, epoch_over)
                if saving or validating or deciding:
                    self.device_clock.wait()
                now = time.perf_counter()
                clock.add(now - started, force=saving)
                if deciding:  # before a save, which then holds the new batch
                    self.record(self.next_batch(self.noise_read(), mid_epoch=True))
                if saving:
                    self.save_open_epoch(state.samples_done, clock.spent - spent_before, loss_sum, steps)
                    if stopping:
                        stop.leave(self.ctx.rank)
                if validating:
                    self.validate_mid_epoch()
                started = time.perf_counter()  # a save's, a decision's or a validation's time is not the loop's
                if self.strategy.finished():  # its progress is made mid-epoch: the epoch ends here
                    break
            self.device_clock.wait()
        finally:  # running out of memory mid-epoch: the time spent so far is lost work, logged on the way out
            clock.add(time.perf_counter() - started, force=True)
        epoch_time = clock.spent - spent_before
        self.step_s = max(self.step_s, epoch_time / max(steps, 1))
        return loss_sum / max(steps, 1), epoch_time

    def epoch_batches(self):
        """The open epoch's batches left, from each rank's `samples_done` on, at the batch in effect: after a change
        of batch mid-epoch the new loader goes on at the next sample of the same permutation, none repeated or
        skipped."""
        state = self.state
        while state.samples_done < self.loader.sampler.num_samples and not self.strategy.finished():
            loader = self.loader
            start_epoch(loader, state.epoch, state.samples_done)
            for batch in self.batches:
                yield batch
                if self.loader is not loader:
                    break
            else:
                return

    def checkpoint_due(self, step: int) -> bool:
        """resources.checkpoint_every_steps: the same steps on every rank, so that they save together."""
        every = self.job.resources.checkpoint_every_steps
        return every is not None and step % every == 0

    def end_epoch(self, loss: torch.Tensor, epoch_time: float) -> None:
        """The strategy's epoch end, validation, the epoch's record (its loss the mean over every rank's steps; the
        batch schedule's decision) and its checkpoint."""
        state, loss = self.state, mean_over_ranks(loss, self.ctx)
        place = self.place_in_run()  # before the epoch closes: a part-run last epoch counts its samples, not all
        strategy_metrics = self.strategy.end_epoch()
        strategy_metrics["noise_scale"] = self.noise_read()
        state.train_time += epoch_time
        state.epoch, state.samples_done, state.open_epoch_steps = state.epoch + 1, 0, 0
        state.open_epoch_time = state.open_epoch_data_wait = state.open_epoch_loss_sum = 0.0
        validation = self.validation.scores(self.micro_batch, self.strategy.precision)
        record = {
            "epoch": state.epoch,
            **place,
            "loss": loss,
            **{f"val_{name}": value for name, value in validation.items()},
            "epoch_time_s": epoch_time,
            "data_wait_s": self.batches.waited,
            "lr": self.strategy.optimizer.param_groups[0]["lr"],
            **strategy_metrics,
        }
        if self.schedule is not None:
            record["batch_schedule"] = self.next_batch(strategy_metrics["noise_scale"])
        state.history.append(record)
        self.save()
        if self.ctx.is_main:
            append_jsonl(self.metrics_path, record)
            print(
                f"[train] epoch {state.epoch}/{self.epochs} loss {loss:.4f} {self.validation.headline(validation)} "
                f"time {epoch_time:.2f}s (data wait {self.batches.waited:.2f}s)",
                flush=True,
            )

    def place_in_run(self) -> dict:
        """What every record says of where the run stands: optimiser steps taken, tokens trained over every rank
        (data.seq_len per sample, an image 1), the global batch in effect."""
        tokens = self.samples_trained() * self.tokens_per_sample
        return {"step": self.state.optimizer_steps, "tokens": tokens, "global_batch": self.global_batch}

    def noise_read(self) -> dict | None:
        """The noise scale measured so far, the same on every rank (a collective: every rank calls it)."""
        noise = self.strategy.noise_scale
        return noise.read() if noise is not None else None

    def record(self, record: dict) -> None:
        """A record between epochs' ends (a validation, a change of batch): in the history and metrics.jsonl."""
        self.state.history.append(record)
        if self.ctx.is_main:
            append_jsonl(self.metrics_path, record)

    def validate_mid_epoch(self) -> None:
        """train.val_every_steps or val_every_tokens: a record of its own (where the run stands, validation scores)."""
        scores = self.validation.scores(self.micro_batch, self.strategy.precision)
        record = {"kind": "validation", **self.place_in_run(), "epoch": self.state.epoch}
        self.record(record | {f"val_{name}": value for name, value in scores.items()})
        if self.ctx.is_main:
            print(f"[train] step {self.state.optimizer_steps} {self.validation.headline(scores)}", flush=True)

    def next_batch(self, noise: dict | None, mid_epoch: bool = False) -> dict:
        """The batch schedule's decision: the batch the run ran at, the one the schedule chooses from the noise scale
        measured so far (every rank reads the same) and the run's place, and the change made, from the next step
        on. Mid-epoch, a record of kind batch_schedule with where the run stands; at an epoch's end, the part of its
        record under `batch_schedule`."""
        ran = self.batch_in_effect()
        choice = self.schedule.choose(self.global_batch, noise, self.samples_trained() / self.run_samples)
        if choice["global_batch"] != self.global_batch and not self.strategy.finished():
            self.use_batch(choice["global_batch"])
            self.state.global_batch, self.state.batch_changed_at = self.global_batch, self.state.optimizer_steps
            if self.ctx.is_main:
                print(
                    f"[train] batch {ran['global_batch']} -> {self.global_batch} after step "
                    f"{self.state.optimizer_steps} ({choice['reason']}, B_noise {choice['b_noise']}; "
                    f"{self.accumulation} slice(s) of {self.micro_batch} per device)",
                    flush=True,
                )
        decision = {"ran": ran, **choice, "next": self.batch_in_effect()}
        if not mid_epoch:
            return decision
        return {"kind": "batch_schedule", **self.place_in_run(), "epoch": self.state.epoch, "batch_schedule": decision}

    def resume(self, checkpoint: dict | None) -> tuple[int, int] | None:
        """The checkpoint of this run (its state already read), restored into the model, the optimiser, the strategy,
        the noise estimator and this rank's RNGs; (epoch, step) resumed from, or None when there is none. The caller
        drops the rest of the checkpoint: it must not hold device memory."""
        if checkpoint is None:
            return None
        self.model.load_state_dict(checkpoint["model"])
        state = self.state
        # The schedule is this attempt's own, at its own step count for the work done (see Strategy.resume):
        # a relaunch at a smaller global batch counts the samples done in its own, smaller steps.
        state.step = self.schedule_place()
        state.restarts.append(state.optimizer_steps)
        self.strategy.resume(checkpoint["optimizer"], state.step)
        self.strategy.load_state_dict(state.strategy)
        if self.strategy.noise_scale is not None and state.noise_scale is not None:  # rank 0's, on every rank
            self.strategy.noise_scale.estimate.load_state_dict(state.noise_scale)
        restore_rng(own_rng_state(checkpoint["rng"], self.ctx.rank, self.ctx.world_size))
        if self.ctx.is_main:
            print(
                f"[train] resuming from checkpoint {self.checkpointer.loaded_from} at epoch {state.epoch} "
                f"({state.samples_done} samples per rank into it), step {state.optimizer_steps}",
                flush=True,
            )
        return state.epoch, state.optimizer_steps

    def save_open_epoch(self, samples_done: int, epoch_time: float, loss_sum: torch.Tensor, steps: int) -> None:
        """The open epoch saved part-way (every rank calls it): its samples per rank, time, data wait, steps and loss
        so far, the loss summed as every rank's mean, so that the resumed epoch's record counts every step."""
        self.step_s = max(self.step_s, epoch_time / steps)
        self.save(
            samples_done=samples_done,
            open_epoch_time=epoch_time,
            open_epoch_data_wait=self.batches.waited,
            open_epoch_loss_sum=mean_over_ranks(loss_sum, self.ctx),
            open_epoch_steps=steps,
        )

    def save(self, **open_epoch) -> None:
        """The state as it stands, with the open epoch's place where it is saved part-way (`open_epoch`: TrainState's
        samples_done and open_epoch_* fields); rank 0 times it (`note_save`)."""
        noise = self.strategy.noise_scale
        state = TrainState(
            **{
                **self.state.state_dict(),
                **open_epoch,
                "strategy": self.strategy.state_dict(),
                "noise_scale": None if noise is None else noise.estimate.state_dict(),
            }
        )
        seconds = self.checkpointer.save(self.model, self.strategy.optimizer, state.state_dict())
        if self.ctx.is_main:
            self.note_save(seconds)

    def note_save(self, seconds: float) -> None:
        """Rank 0: the longest save and step so far, kept beside the checkpoint for the stage to size the next job's
        warning; this attempt's first save says where the warning in effect is too short for them."""
        times = self.stop_times = replace(
            self.stop_times,
            save_s=max(self.stop_times.save_s, seconds),
            step_s=max(self.stop_times.step_s, self.step_s),
        )
        times.write(self.checkpoint_path)
        if self.first_save and self.stop_warning_s is not None and self.stop_warning_s < times.needed_s():
            print(
                f"[train] a checkpoint save took {seconds:.1f} s and a step {self.step_s:.2f} s: the warning before "
                f"the time limit, {self.stop_warning_s} s, is too short to finish a step and save with a margin "
                f"({times.needed_s():.0f} s); the next job's warning is sized from these times",
                flush=True,
            )
        self.first_save = False

    def summary(self) -> dict:
        state, device = self.state, self.ctx.device
        return {
            "nodes": None,
            "global_batch": self.global_batch,
            "per_device_batch": self.per_device,
            "batch_schedule": self.job.train.batch_schedule,
            "optimizer_steps": state.optimizer_steps,
            "world_size": self.ctx.world_size,
            "accumulation": self.accumulation,
            "micro_batch": self.micro_batch,
            "epochs": state.epoch,
            "max_epochs": self.epochs,
            "steps": state.step,
            "steps_per_epoch": self.steps_per_epoch,
            "strategy": self.strategy.name,
            "train_samples": len(self.splits.train),
            # data.seq_len per sample (an image's 1) over every rank, to the run's end (its last epoch's record)
            "tokens": next((r["tokens"] for r in reversed(state.history) if "tokens" in r), 0),
            "train_time_s": state.train_time,
            "resumed_from_epoch": None if self.resumed_from is None else self.resumed_from[0],
            "resumed_from_step": None if self.resumed_from is None else self.resumed_from[1],
            "restarts_at_steps": state.restarts,
            "history": state.history,
            # The device as training found it, for the report to hold against the memory model: the peaks the
            # steps allocated and the allocator reserved, and what it does not hold (CUDA context, NCCL's
            # communicators) with every process group formed. Nothing outside the allocator on the CPU.
            "peak_allocated_bytes": device_memory.peak(device, "allocated"),
            "peak_reserved_bytes": device_memory.peak(device, "reserved"),
            "outside_allocator_bytes": device_memory.outside_allocator(device),
        }
