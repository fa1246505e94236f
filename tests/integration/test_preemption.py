"""Preemption mid-epoch on the local launcher: submitit's requeue signal reaches both ranks in the middle of an
epoch; they agree on a step, rank 0 saves it and requeues, and the requeued job ends where an uninterrupted
one does."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest
import torch

from tests.conftest import paced_job, train_stage, wait_for
from tula_hpc.training.preemption import REQUEUE_SIGNAL

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _checkpoint(path) -> dict | None:
    return torch.load(path, weights_only=False) if path.exists() else None


def test_requeue_signal_mid_epoch_on_two_ranks_resumes_at_that_step_to_the_same_weights(tmp_path):
    name, config_path = paced_job(tmp_path / "preempted", epochs=4, time_min=30)
    stage = train_stage(tmp_path, name, config_path, "local", "preempted", background=True, nodes=2, batch=128)
    work = tmp_path / "preempted" / "work" / "train"
    wait_for(
        lambda: (c := _checkpoint(work / "checkpoint.pt")) and c["state"]["epoch"] >= 1, 300, "epoch 1", interval=0.2
    )
    # About 1 s into epoch 2 (10 paced steps of 0.2 s each): mid-epoch.
    time.sleep(1.0)
    controller = psutil.Process(int(json.loads((work / "job.json").read_text())["job_id"]))
    ranks = controller.children()
    assert len(ranks) == 2
    for rank in ranks:
        rank.send_signal(REQUEUE_SIGNAL)
    out, _ = stage.communicate(timeout=600)
    assert stage.returncode == 0, out[-3000:]

    ref_name, ref_config = paced_job(tmp_path / "reference", epochs=4, model="tiny_cnn", time_min=30)
    reference = train_stage(tmp_path, ref_name, ref_config, "local", "reference", nodes=2, batch=128)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    summary = json.loads((tmp_path / "preempted" / "out" / "summary.json").read_text())
    [restart] = summary["restarts_at_steps"]
    assert summary["steps_per_epoch"] < restart < 2 * summary["steps_per_epoch"], "resumed mid-epoch 2"
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3, 4]
    assert signal.Signals(REQUEUE_SIGNAL).name in out
    resumed = torch.load(tmp_path / "preempted" / "out" / "model.pt", weights_only=False)["model"]
    uninterrupted = torch.load(tmp_path / "reference" / "out" / "model.pt", weights_only=False)["model"]
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
