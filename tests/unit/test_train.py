"""Stage train: every strategy trains, a resume continues exactly, out of memory relaunches, lost work is timed."""

import json
import math
import os
import signal
import time

import pytest
import torch

import tula_hpc.stages.train as train_module
import tula_hpc.training.loop_accounting as loop_accounting
import tula_hpc.training.step as training_module
import tula_hpc.training.trainer as trainer_module
import tula_hpc.training.validation as validation_module
from tests.conftest import default_job
from tests.unit.report_inputs import INPUTS
from tula_hpc.core.job import Job
from tula_hpc.core.records import TrainSummary
from tula_hpc.reporting.training_section import strategy_section
from tula_hpc.training.attempts import StopTimes, after_out_of_memory, stop_warning_s
from tula_hpc.training.handoff import TrainHandoff
from tula_hpc.training.loop_accounting import STEP_TRACE_ENV, LoopClock, TimedBatches, loop_time_s
from tula_hpc.training.preemption import REQUEUE_SIGNAL, Preempted
from tula_hpc.training.strategies import STRATEGIES
from tula_hpc.training.trainer import accumulation_for, train_worker


def _run_training(job: Job, tmp_path, batch: int = 256, **worker) -> tuple[dict, dict]:
    paths = dict(
        checkpoint_path=str(tmp_path / "checkpoint.pt"),
        model_path=str(tmp_path / "model.pt"),
        metrics_path=str(tmp_path / "metrics.jsonl"),
    )
    summary = train_worker(job, batch, **paths, **worker)
    return summary, torch.load(paths["model_path"], weights_only=False)["model"]


def _requeue_signal_during_step(monkeypatch, number: int) -> None:
    """The requeue signal arrives while training's `number`-th step runs, as Slurm's warning would."""
    step, calls = training_module.training_step, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            os.kill(os.getpid(), REQUEUE_SIGNAL)
        return step(*args, **kwargs)

    monkeypatch.setattr(training_module, "training_step", signalled)


def _crashed_then_resumed(
    job: Job, folder, monkeypatch, module, function: str, at_call: int, batch: int = 256, **worker
):
    """Training whose `module.function` raises at its `at_call`-th call (no signal, nothing saved on the way out), then
    run again: (the resumed run's summary, its weights, every step rank 0 ran, in order: loop_accounting.StepTrace)."""
    original, calls = getattr(module, function), []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("node lost")
        return original(*args, **kwargs)

    trace = folder.with_name(f"{folder.name}.steps")
    monkeypatch.setattr(module, function, crashing)
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))
    with pytest.raises(RuntimeError, match="node lost"):
        _run_training(job, folder, batch=batch, **worker)
    monkeypatch.setattr(module, function, original)
    summary, resumed = _run_training(job, folder, batch=batch, **worker)
    return summary, resumed, [int(step) for step in trace.read_text().split()]


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_every_strategy_trains_the_tiny_cnn(name, tmp_path):
    job = default_job(train=dict(strategy=name, epochs=10, warmup_epochs=2, lr_milestones=[8], polo={"sync_epochs": 2}))
    summary, _ = _run_training(job, tmp_path)
    assert summary["strategy"] == name
    assert summary["history"][-1]["val_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if name in ("ags", "static"):
        ags = [r["ags"] for r in records]
        assert all(a["steps"] == summary["steps_per_epoch"] for a in ags)
        assert 0 < sum(a["scaled_steps"] for a in ags) < summary["steps"]
        assert (ags[-1]["scale_hist"] is None) == (name == "static")
        if name == "ags":
            assert [a["gradscale_updates"] for a in ags] == [0] + [1] * 9  # once per epoch, from the second
    else:
        assert all("ags" not in r for r in records)
    timed = summary["train_time_s"]  # train() adds the times the worker does not know: no work lost, no wait here
    recorded = TrainSummary.from_dict({**summary, "train_time_with_lost_work_s": timed, "wall_time_s": timed})
    section = strategy_section(recorded, tmp_path / "training.png", tmp_path / "report.md")
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"  # every strategy gets its training curves
    if name in ("ags", "static"):
        scaled = sum(r["ags"]["scaled_steps"] for r in records)
        assert f"{scaled} of {summary['steps']} steps" in section
    else:
        assert f"`{name}`: no gradient scaling" in section


@pytest.mark.parametrize("name", ["ags", "lrs", "adascale"])  # adascale: its progress resumes too
@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_interrupted_training_resumes_to_the_same_weights(name, tmp_path, monkeypatch):
    job = default_job(train=dict(strategy=name, epochs=5, warmup_epochs=2, lr_milestones=[4]))
    _, uninterrupted = _run_training(job, tmp_path / "whole")

    # the third epoch's validation crashes: its steps ran before the crash, and again
    summary, resumed, steps = _crashed_then_resumed(
        job, tmp_path / "split", monkeypatch, validation_module, "evaluate_metrics", 3
    )

    assert summary["resumed_from_epoch"] == 2
    second_run = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    crashed_at, resumed_at = steps[second_run - 1], summary["resumed_from_step"]
    assert steps == [*range(1, crashed_at + 1), *range(resumed_at + 1, summary["steps"] + 1)]
    assert crashed_at - resumed_at > 0
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


class ScriptedSchedule:
    """train.batch_schedule adaptive's part the Trainer calls, moving the batch by a table (batch -> next) whatever
    the noise scale: one rank measures none (the real choice is tests/unit/test_batch_schedule.py's)."""

    def __init__(self, moves: dict[int, int]):
        self.moves = moves

    def start(self, selected_batch: int) -> int:
        return selected_batch

    def due(self, before: float, after: float) -> bool:
        return False  # at epochs' ends only

    def choose(self, global_batch: int, noise: dict | None, progress: float) -> dict:
        return {"global_batch": self.moves.get(global_batch, global_batch), "b_noise": None, "reason": "scripted"}


ADAPTIVE = dict(epochs=4, warmup_epochs=1, lr_milestones=[3], batch_schedule="adaptive")
MOVES = {256: 128, 128: 512}  # 256 for the first epoch, 128 for the second, 512 from the third


@pytest.mark.parametrize("name", ["lrs", "ags", "adascale"])
@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_a_resume_across_a_change_of_batch_gives_the_uninterrupted_weights(name, tmp_path, monkeypatch):
    """The batch changes at epochs' ends, each epoch's record says so, and a crash in the third epoch (at 512, after
    two changes) resumes at the checkpoint's batch to the uninterrupted run's weights, bit for bit."""
    job = default_job(train=dict(strategy=name, **ADAPTIVE))
    whole, uninterrupted = _run_training(job, tmp_path / "whole", schedule=ScriptedSchedule(MOVES))
    ran = [h["batch_schedule"]["ran"]["global_batch"] for h in whole["history"]]
    assert ran[:3] == [256, 128, 512] and set(ran[3:]) <= {512}
    per_epoch = {b: -(-whole["train_samples"] // b) for b in (256, 128, 512)}
    assert whole["optimizer_steps"] <= sum(per_epoch[b] for b in ran) and whole["global_batch"] == 512
    assert whole["steps_per_epoch"] == per_epoch[512]
    summary, resumed, _ = _crashed_then_resumed(
        job, tmp_path / "split", monkeypatch, validation_module, "evaluate_metrics", 3, schedule=ScriptedSchedule(MOVES)
    )
    assert summary["resumed_from_epoch"] == 2 and summary["global_batch"] == 512
    assert summary["optimizer_steps"] == whole["optimizer_steps"]
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_a_run_preempted_mid_epoch_after_a_change_of_batch_ends_with_the_same_weights(tmp_path, monkeypatch):
    job = default_job(train=dict(strategy="lrs", **ADAPTIVE))
    _, uninterrupted = _run_training(job, tmp_path / "whole", schedule=ScriptedSchedule(MOVES))
    first_epoch = -(-1 * len_train(job) // 256)
    _requeue_signal_during_step(monkeypatch, first_epoch + 3)  # in the second epoch, at 128
    with pytest.raises(Preempted):
        _run_training(job, tmp_path / "split", schedule=ScriptedSchedule(MOVES))
    monkeypatch.undo()
    saved = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)["state"]
    assert saved["epoch"] == 1 and saved["global_batch"] == 128 and saved["samples_done"] == 4 * 128
    summary, resumed = _run_training(job, tmp_path / "split", schedule=ScriptedSchedule(MOVES))
    assert summary["resumed_from_epoch"] == 1
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


def len_train(job: Job) -> int:
    from tula_hpc.training.datasets import load_splits

    return len(load_splits(job.data, job.train.seed).train)


@pytest.mark.parametrize("name", ["ags", "lars"])
@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_a_run_preempted_mid_epoch_saves_that_step_and_ends_with_the_same_weights(name, tmp_path, monkeypatch):
    """submitit's requeue signal in the middle of an epoch: the step it arrives in is finished and saved with
    the sampler's position and the RNG, and the resumed run matches an uninterrupted one bit for bit."""
    job = default_job(train=dict(strategy=name, epochs=3, warmup_epochs=1, lr_milestones=[2]))
    _, uninterrupted = _run_training(job, tmp_path / "whole", batch=128)

    _requeue_signal_during_step(monkeypatch, 12)
    trace = tmp_path / "steps.trace"
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))
    with pytest.raises(Preempted):
        _run_training(job, tmp_path / "split", batch=128)
    monkeypatch.undo()
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))
    saved = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    # Steps are agreed on before they start: the signal noted during step 12 stops the run after step 13.
    assert (saved["state"]["epoch"], saved["state"]["step"], saved["state"]["samples_done"]) == (1, 13, 3 * 128)
    summary, resumed = _run_training(job, tmp_path / "split", batch=128)

    assert summary["restarts_at_steps"] == [13] and summary["resumed_from_step"] == 13
    assert [int(step) for step in trace.read_text().split()] == list(range(1, 31))  # no step ran twice
    assert [h["step"] for h in summary["history"]] == [10, 20, 30]
    assert signal.getsignal(REQUEUE_SIGNAL) == signal.SIG_DFL  # the loop gives the handlers back
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_a_kill_without_warning_costs_at_most_the_steps_since_the_last_interval_checkpoint(tmp_path, monkeypatch):
    """resources.checkpoint_every_steps: 3. A crash in step 15 (no signal: nothing is saved on the way out) resumes
    from step 12's checkpoint, so steps 13 and 14 run twice, and the weights end as an uninterrupted run's."""
    job = default_job(train=dict(strategy="ags", epochs=3, lr_milestones=[2]), resources=dict(checkpoint_every_steps=3))
    _, uninterrupted = _run_training(job, tmp_path / "whole", batch=128)

    summary, resumed, steps = _crashed_then_resumed(
        job, tmp_path / "split", monkeypatch, training_module, "training_step", 15, batch=128
    )

    assert summary["restarts_at_steps"] == [12]
    assert steps == [*range(1, 15), *range(13, 31)]
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


def test_loop_time_counts_every_session_kept_or_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(loop_accounting, "LOOP_LOG_EVERY_S", 5.0)
    log = tmp_path / "loop_time.jsonl"
    first, second = LoopClock(log), LoopClock(log)
    first.add(3.0)  # under the logging interval: not yet logged
    assert loop_time_s(log) == 0.0
    first.add(4.0)  # 7 s: logged
    second.add(1.0, force=True)  # a session on its way out (OOM) logs at once
    first.add(0.5)  # the kill comes before the next log line: at most one interval is lost to the log
    assert loop_time_s(log) == 7.0 + 1.0
    assert loop_time_s(tmp_path / "missing.jsonl") == 0.0


def test_the_epoch_clock_waits_for_the_device_at_epoch_ends_and_mid_epoch_saves_not_every_step(tmp_path, monkeypatch):
    """A stand-in CUDA device (its synchronize recorded): kernels still queued when the loop's last step returns
    are the epoch's time, so the clock that closes an epoch or a mid-epoch save waits for them first; a wait at
    every step would take away the overlap of host and device that training really has."""
    job = default_job(train=dict(strategy="lrs", epochs=2, warmup_epochs=1, lr_milestones=[]))
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(("wait", device)))
    monkeypatch.setattr(trainer_module, "clock_for", training_module.CudaClock)
    add = LoopClock.add

    def read(clock, seconds, force=False):
        events.append(("read", force))
        add(clock, seconds, force)

    monkeypatch.setattr(LoopClock, "add", read)
    _requeue_signal_during_step(monkeypatch, 12)
    with pytest.raises(Preempted):
        _run_training(job, tmp_path, batch=128)  # 10 steps an epoch; stops mid-epoch 2, after step 13

    waits = [i for i, event in enumerate(events) if event[0] == "wait"]
    assert [events[i] for i in waits] == [("wait", torch.device("cpu"))] * 2  # epoch 1's end, step 13's save
    assert all(events[i + 1] == ("read", True) for i in waits)  # each followed at once by the closing reading
    assert sum(event == ("read", False) for event in events) == 10 + 2  # the other steps read without waiting


def test_the_time_the_loop_waited_for_its_loader_is_counted_per_epoch(tmp_path):
    def slow_loader():
        for batch in range(3):
            time.sleep(0.05)
            yield batch

    batches = TimedBatches(type("Loader", (), {"__iter__": lambda self: slow_loader()})())
    seen = []
    for batch in batches:
        seen.append(batch)
        time.sleep(0.1)  # the step: not the loader's time
    assert seen == [0, 1, 2] and 0.15 <= batches.waited < 0.25

    job = default_job(train=dict(strategy="lrs", epochs=2, warmup_epochs=1, lr_milestones=[]))
    summary, _ = _run_training(job, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_wait_s"] for r in summary["history"]] == [r["data_wait_s"] for r in records]
    assert all(0 < r["data_wait_s"] < r["epoch_time_s"] for r in records)


def test_a_goodput_choice_trains_the_epochs_its_batch_needs_with_the_schedule_stretched():
    job = default_job(train={"epochs": 10, "lr_milestones": [5, 8]}, objective={"minimize": "goodput"})
    stretched = train_module.stretched_to_progress(job, {"progress_epochs": 19.2})
    assert stretched.train.epochs == 20 and stretched.train.lr_milestones == (10, 16)
    assert job.train.epochs == 10  # the job itself is not changed
    for unchanged in (
        default_job(train={"epochs": 10, "lr_milestones": [5, 8]}),  # the recipe's epochs for time, cost, knee
        default_job(
            train={"strategy": "adascale", "epochs": 10, "lr_milestones": []}, objective={"minimize": "goodput"}
        ),
    ):
        assert train_module.stretched_to_progress(unchanged, {"progress_epochs": 19.2}) is unchanged


def test_slices_stay_within_the_cap_set_after_running_out_of_memory():
    assert accumulation_for(64, None) == 1
    assert accumulation_for(64, 64) == 1
    assert accumulation_for(64, 16) == 4
    assert accumulation_for(100, 32) == 4


class _Stop(Exception):
    """Ends the stage's loop of attempts where the test has seen enough."""


def test_the_stage_hands_each_attempt_a_typed_handoff_and_shrinks_it_after_running_out_of_memory(tmp_path, monkeypatch):
    handoffs = []

    def run(worker, kwargs, spec, folder, name):
        assert worker == train_module.TRAIN_WORKER and set(kwargs) == {"handoff"}
        handoffs.append(kwargs["handoff"])
        if len(handoffs) == 1:
            return None, {"outcome": "out_of_memory", "rank": 1, "error": "out of memory", "noticed_after_s": 0.1}
        raise _Stop

    monkeypatch.setattr(train_module.launch, "run_or_out_of_memory", run)
    (tmp_path / "selection.json").write_text(json.dumps(INPUTS["selection"]))
    job = default_job()
    with pytest.raises(_Stop):
        train_module.train(job, tmp_path / "selection.json", tmp_path / "s.json", tmp_path / "m.pt", tmp_path / "w")
    first, second = handoffs
    assert isinstance(first, TrainHandoff) and first.job == job and first.schedule is None
    assert (first.global_batch, first.accumulation, first.selected_batch) == (128, 1, 128)
    shrunk = after_out_of_memory(job.resources.on_oom, 128, 1, world_size=2)
    assert (second.global_batch, second.accumulation) == shrunk
    assert first.checkpoint_path == second.checkpoint_path == str(tmp_path / "w" / "train" / "checkpoint.pt")
    assert first.model_path == str((tmp_path / "m.pt").resolve())


@pytest.mark.slow  # trains the tiny CNN for real: 25-75 s each, not in the fast tier
def test_a_stop_on_an_epochs_last_step_saves_before_validating_and_the_resumed_run_ends_that_epoch(
    tmp_path, monkeypatch
):
    """The requeue signal noted during step 9 stops the run after step 10, epoch 1's last: it saves the epoch's steps
    and leaves without validating (under a short grace time validation would be killed, the steps lost); the resumed
    run runs none of them again, validates, records epoch 1 as an uninterrupted run does, and ends with its weights."""
    job = default_job(train=dict(strategy="lrs", epochs=2, warmup_epochs=1, lr_milestones=[]))
    whole, uninterrupted = _run_training(job, tmp_path / "whole", batch=128)

    validations, evaluate = [], validation_module.evaluate_metrics
    counted = lambda *a, **k: validations.append(1) or evaluate(*a, **k)  # noqa: E731
    monkeypatch.setattr(validation_module, "evaluate_metrics", counted)
    _requeue_signal_during_step(monkeypatch, 9)
    trace = tmp_path / "steps.trace"
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))
    with pytest.raises(Preempted):
        _run_training(job, tmp_path / "split", batch=128)
    assert validations == [], "the stop saved and left before validating"
    saved = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)["state"]
    assert (saved["epoch"], saved["step"], saved["open_epoch_steps"], saved["history"]) == (0, 10, 10, [])
    monkeypatch.undo()
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))
    summary, resumed = _run_training(job, tmp_path / "split", batch=128)

    assert summary["restarts_at_steps"] == [10]
    assert [int(step) for step in trace.read_text().split()] == list(range(1, 21))  # no step ran twice
    kept = ("epoch", "step", "loss", "val_accuracy", "lr")
    assert [{k: h[k] for k in kept} for h in summary["history"]] == [{k: h[k] for k in kept} for h in whole["history"]]
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow  # trains the tiny CNN for real
def test_the_loop_keeps_its_longest_save_and_step_and_says_when_the_warning_is_too_short(tmp_path, capsys):
    """Rank 0 times each checkpoint save; the record beside the checkpoint is what the stage sizes the next warning
    from, and a warning of 1 s (shorter than any step and save with their margin) is named in the log once."""
    job = default_job(train=dict(strategy="lrs", epochs=2, warmup_epochs=1, lr_milestones=[]))
    _run_training(job, tmp_path, batch=128, stop_warning_s=1)
    times = StopTimes.read(tmp_path / "checkpoint.pt")
    assert times.save_s > 0 and times.step_s > 0
    assert stop_warning_s(times, 60) == max(60, math.ceil(2 * times.save_s + 2 * times.step_s + 30))
    log = capsys.readouterr().out
    assert log.count("the warning before the time limit, 1 s, is too short") == 1


def test_the_stage_sizes_each_attempts_warning_from_the_saves_measured_so_far(tmp_path, monkeypatch):
    """No measurement before the first attempt: today's warning (a quarter of short limits, 90 s at most); the second
    attempt's job is warned as the first attempt's saves need, and its loop is told the warning it gets."""
    launched = []

    def run(worker, kwargs, spec, folder, name):
        launched.append((spec, kwargs["handoff"]))
        if len(launched) == 1:
            StopTimes(save_s=100.0, step_s=5.0).write(kwargs["handoff"].checkpoint_path)  # as the loop records it
            return None, {"outcome": "out_of_memory", "rank": 0, "error": "out of memory", "noticed_after_s": 0.1}
        raise _Stop

    monkeypatch.setattr(train_module.launch, "run_or_out_of_memory", run)
    monkeypatch.setattr(train_module, "train_job_minutes", lambda job, selection: 30)  # no partition to ask
    (tmp_path / "selection.json").write_text(json.dumps(INPUTS["selection"]))
    job = default_job().updated(launcher="slurm")
    with pytest.raises(_Stop):
        train_module.train(job, tmp_path / "selection.json", tmp_path / "s.json", tmp_path / "m.pt", tmp_path / "w")
    (first, first_handoff), (second, second_handoff) = launched
    assert first.stop_warning_s is None
    assert first_handoff.stop_warning_s == first.warning_before_limit_s == 90  # 30 minutes: 90 s
    assert second.stop_warning_s == second_handoff.stop_warning_s == second.warning_before_limit_s == 240


def test_a_run_measured_in_steps_stops_mid_epoch_validating_every_few_steps_on_a_fixed_subset(tmp_path):
    job = default_job(
        train=dict(strategy="lbt", steps=5, val_every_steps=2, val_samples=40, lr_schedule={"kind": "cosine"})
    )
    summary, _ = _run_training(job, tmp_path, batch=32)
    assert summary["optimizer_steps"] == 5 < summary["steps_per_epoch"]
    assert summary["epochs"] == 1 and summary["tokens"] == 5 * 32  # an image is one unit
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 5] and "epoch_time_s" in records[-1]
    assert [
        r["step"]
        for r in TrainSummary.from_dict(
            {**summary, "wall_time_s": 0.0, "train_time_with_lost_work_s": 0.0}
        ).epoch_history
    ] == [5]
    # the cosine schedule ends at the run's last step (its floor, lr x min_lr_ratio)
    assert records[-1]["lr"] == pytest.approx(job.train.lr * job.train.lr_schedule.min_lr_ratio)
