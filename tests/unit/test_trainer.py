"""trainer.py's batch schedule during the run: a ramp changes the batch mid-epoch, every sample of the epoch is
trained once, the rate's schedule lies over samples, and a resume across a change is bit-equal."""

import pytest
import torch

import tula_hpc.training.loaders as loaders_module
import tula_hpc.training.step as training_module
from tests.conftest import default_job
from tests.unit.test_train import _crashed_then_resumed, _run_training, len_train
from tula_hpc.performance.batch_schedule import BatchRamp

ONE_PROCESS = dict(data=dict(num_workers=0), search=dict(nodes={"min": 1, "max": 1}))


def ramp_job(**train):
    return default_job(train=dict(batch_schedule="ramp", lr_milestones=[], **train), **ONE_PROCESS)


def test_a_ramp_changes_the_batch_mid_epoch_and_trains_every_sample_of_the_epoch_once(tmp_path, monkeypatch):
    seen, iterate = [], loaders_module.EpochSampler.__iter__

    def recorded(sampler):
        for index in iterate(sampler):
            seen.append(index)
            yield index

    monkeypatch.setattr(loaders_module.EpochSampler, "__iter__", recorded)
    job = ramp_job(strategy="lbt", epochs=1)
    summary, _ = _run_training(job, tmp_path, batch=64, schedule=BatchRamp(16, 64, 0.5))
    samples = len_train(job)
    assert sorted(seen) == list(range(samples))  # none repeated, none skipped, across two changes of loader
    changes = [r for r in summary["history"] if r.get("kind") == "batch_schedule"]
    moves = [(r["batch_schedule"]["ran"]["global_batch"], r["batch_schedule"]["next"]["global_batch"]) for r in changes]
    assert moves == [(16, 32), (32, 64)] and summary["global_batch"] == 64
    # each change after the step that passed a quarter and a half of the epoch's samples
    assert [r["tokens"] for r in changes] == [16 * -(-samples // 64), 16 * 20 + 32 * -(-(samples // 2 - 320) // 32)]
    assert summary["optimizer_steps"] == 20 + 10 + -(-(samples - changes[1]["tokens"]) // 64)
    assert summary["history"][-1]["tokens"] == samples


def test_cosine_under_a_ramp_ends_its_decay_at_the_runs_last_sample(tmp_path):
    schedule = {"kind": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1}
    job = ramp_job(strategy="lbt", epochs=1, lr_schedule=schedule)
    summary, _ = _run_training(job, tmp_path, batch=64, schedule=BatchRamp(16, 64, 0.5))
    last = summary["history"][-1]
    assert last["tokens"] == len_train(job) and last["lr"] == pytest.approx(job.train.lr * 0.1)


@pytest.mark.parametrize("moments", ["keep", "reset"])
def test_a_run_resumed_just_after_a_change_mid_epoch_ends_bit_equal(moments, tmp_path, monkeypatch):
    """Two epochs, 16 to 64 over the first half: 16 -> 32 after step 40, mid-epoch, where the checkpoint every 40
    steps saves it; a crash at step 43 resumes at 32 from the epoch's 640th sample, then 32 -> 64 at the epoch's end."""
    job = default_job(
        train=dict(
            strategy="lrs",
            optimizer="adamw",
            lr=1e-3,
            epochs=2,
            warmup_epochs=1,
            lr_milestones=[],
            batch_schedule="ramp",
            adam_moments_on_batch_change=moments,
        ),
        resources=dict(checkpoint_every_steps=40),
        **ONE_PROCESS,
    )
    ramp = BatchRamp(16, 64, 0.5)
    whole, uninterrupted = _run_training(job, tmp_path / "whole", batch=64, schedule=ramp)
    summary, resumed, steps = _crashed_then_resumed(
        job, tmp_path / "split", monkeypatch, training_module, "training_step", 43, batch=64, schedule=ramp
    )
    assert summary["restarts_at_steps"] == [40] and steps[40:43] == [41, 42, 41]
    assert summary["optimizer_steps"] == whole["optimizer_steps"] and summary["global_batch"] == 64
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key
