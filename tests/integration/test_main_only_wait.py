"""Rank 0's work alone (a checkpoint) outlasts the collective timeout: the others wait for it outside collectives.

Two CPU ranks on gloo with a 3 s collective timeout; rank 0 takes 6 s to write the first checkpoint. Waiting
in their next collective, the others would time out (under NCCL its watchdog would end the job); they wait
on the long-timeout group instead, and the job ends normally. The checkpoint holds each rank's RNG states,
and a resume restores each rank its own.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

import tula_hpc.training.checkpoint as checkpoint_module
import tula_hpc.training.step as training_module
import tula_hpc.training.trainer as train_module
from tests.conftest import default_job, free_port
from tula_hpc.core.job import Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SLOW_SAVE_S = 6


def _rank(rank: int, port: int, job: Job, folder: str) -> None:
    """train_worker on one of two ranks: rank 0's first save is slow; each rank's RNG is seeded apart (after
    the set-up seeds them alike) and what it restores on a resume is written down."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    build, save, restore, saves = (
        training_module.build_for_job,
        checkpoint_module.save_checkpoint,
        train_module.restore_rng,
        [],
    )

    def build_then_seed_apart(job, ctx):
        built = build(job, ctx)
        torch.manual_seed(100 + rank)
        return built

    def slow_first_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 1:
            time.sleep(SLOW_SAVE_S)
        save(*args, **kwargs)

    def restore_and_note(state):
        torch.save(state, f"{folder}/restored{rank}.pt")
        restore(state)

    train_module.build_for_job = build_then_seed_apart
    checkpoint_module.save_checkpoint = slow_first_save
    train_module.restore_rng = restore_and_note
    paths = {f"{name}_path": f"{folder}/{name}" for name in ("checkpoint", "model", "metrics")}
    train_module.train_worker(job, 128, **paths)


def _train_on_two_ranks(job: Job, folder) -> None:
    mp.spawn(_rank, args=(free_port(), job, str(folder)), nprocs=2, join=True)


def test_ranks_wait_for_a_checkpoint_longer_than_the_collective_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TULA_COLLECTIVE_TIMEOUT_S", "3")  # read by the ranks' processes as they import
    job = default_job(train=dict(strategy="lrs", epochs=2, warmup_epochs=1, lr_milestones=[]))
    started = time.perf_counter()
    _train_on_two_ranks(job, tmp_path)
    assert time.perf_counter() - started > SLOW_SAVE_S
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics").read_text().splitlines()] == [1, 2]

    saved = torch.load(tmp_path / "checkpoint", weights_only=False)["rng"]
    assert len(saved) == 2 and not torch.equal(saved[0]["torch"], saved[1]["torch"])
    _train_on_two_ranks(job, tmp_path)  # a resume after the last epoch: it restores, then has nothing to do
    for rank in (0, 1):
        assert torch.equal(
            torch.load(tmp_path / f"restored{rank}.pt", weights_only=False)["torch"], saved[rank]["torch"]
        )
