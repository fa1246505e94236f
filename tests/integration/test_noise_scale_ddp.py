"""The noise-scale comm hook on a real DDP model of two gloo ranks: it all-reduces the gradient as DDP's own hook
does (every rank ends with the mean) and its squared norms are those of the rank's own gradient and of the mean,
computed here by hand; a training run records the noise scale in metrics.jsonl every epoch."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.conftest import default_job, free_port
from tula_hpc.core.job import Job
from tula_hpc.training.noise_scale import NoiseScaleHook, two_batch_estimates

pytestmark = [pytest.mark.integration]


def _rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    by_hand = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    by_hand.load_state_dict(model.state_dict())
    net = DDP(model, bucket_cap_mb=0.0001)  # several buckets: the hook sums them
    hook = NoiseScaleHook(2)
    hook.attach(net)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    nn.functional.cross_entropy(net(x), y).backward()
    nn.functional.cross_entropy(by_hand(x), y).backward()
    local = torch.cat([p.grad.flatten() for p in by_hand.parameters()])
    mean = local.clone()
    dist.all_reduce(mean)
    mean /= 2
    synced = torch.cat([p.grad.flatten() for p in model.parameters()])
    record = {
        "synced_is_mean": bool(torch.allclose(synced, mean, atol=1e-6)),
        "small": float(hook._small),
        "local_sq": float(local @ local),
        "big": float(hook._big),
        "mean_sq": float(mean @ mean),
    }
    hook.end_step(8)
    expected = two_batch_estimates(record["local_sq"], record["mean_sq"], 8, 16)
    record["estimate"] = [float(v) for v in hook.estimate.averages()]
    record["expected"] = [float(v) for v in expected]
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def test_the_hook_all_reduces_as_ddp_does_and_reads_both_batch_sizes(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["synced_is_mean"]
        assert record["small"] == pytest.approx(record["local_sq"], rel=1e-5)
        assert record["big"] == pytest.approx(record["mean_sq"], rel=1e-5)
        assert record["estimate"] == pytest.approx(record["expected"], rel=1e-5)


def _train(rank: int, port: int, job: Job, folder: str) -> None:
    from tula_hpc.training.trainer import train_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    paths = {f"{name}_path": f"{folder}/{name}" for name in ("checkpoint", "model", "metrics")}
    train_worker(job, 64, **paths)


def test_training_records_the_noise_scale_every_epoch(tmp_path):
    job = default_job(train=dict(epochs=2, lr_milestones=[]))
    mp.start_processes(_train, args=(free_port(), job, str(tmp_path)), nprocs=2, start_method="spawn")
    epochs = [json.loads(line) for line in (tmp_path / "metrics").read_text().splitlines()]
    assert len(epochs) == 2
    for epoch in epochs:
        noise = epoch["noise_scale"]
        assert noise["steps"] == epoch["step"] and noise["trace_sigma"] > 0


def _train_adascale(rank: int, port: int, job: Job, folder: str) -> None:
    from tula_hpc.training.trainer import train_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    paths = {f"{name}_path": f"{folder}/{name}" for name in ("checkpoint", "model", "metrics")}
    summary = train_worker(job, 128, **paths)
    if summary is not None:
        with open(f"{folder}/summary.json", "w") as f:
            json.dump(summary, f)


def test_adascale_trains_until_the_base_recipes_progress_in_fewer_steps(tmp_path):
    """The recipe: 2 epochs at batch 32; AdaScale at 128 (4x) trains more epochs than 2, fewer steps than the
    recipe's, and stops once its progress reaches the recipe's steps."""
    job = default_job(train=dict(strategy="adascale", epochs=2, lr_milestones=[], lr_base_batch=32))
    mp.start_processes(_train_adascale, args=(free_port(), job, str(tmp_path)), nprocs=2, start_method="spawn")
    summary = json.loads((tmp_path / "summary.json").read_text())
    last = summary["history"][-1]["adascale"]
    base_steps = 2 * -(-summary["train_samples"] // 32)
    assert last["progress"] >= last["target"] == pytest.approx(base_steps, abs=2)
    assert 2 < summary["epochs"] <= summary["max_epochs"] == 8
    assert summary["steps"] < base_steps


def _train_on_schedule(rank: int, port: int, job: Job, folder: str, schedule) -> None:
    from tula_hpc.training.trainer import train_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    paths = {f"{name}_path": f"{folder}/{name}" for name in ("checkpoint", "model", "metrics")}
    summary = train_worker(job, 32, **paths, schedule=schedule)
    if summary is not None:
        with open(f"{folder}/summary.json", "w") as f:
            json.dump(summary, f)


def test_an_adaptive_batch_follows_the_noise_scale_two_ranks_measure(tmp_path):
    """train.batch_schedule adaptive on two gloo ranks: every 20th of the run and at each epoch's end the goodput
    choice among candidates whose best batch grows with the noise scale (a step of a + c B), made from the scale the
    run measured, on both ranks alike; the run trains on at the chosen batch and says so in metrics.jsonl. The step's
    fixed part is large enough (20 ms) that the scale these ranks measure (about 30) chooses a batch above the first."""
    from tests.unit.test_batch_schedule import SAMPLES, fastest_to_progress, rows
    from tula_hpc.performance.batch_schedule import BatchSchedule

    job = default_job(
        train=dict(strategy="adascale", epochs=3, lr_milestones=[], lr_base_batch=32, batch_schedule="adaptive"),
        objective={"minimize": "goodput"},
    )
    latency = 20e-3
    schedule = BatchSchedule(job, tuple(r for r in rows(latency_s=latency) if r["batch"] <= 256), SAMPLES)
    mp.start_processes(
        _train_on_schedule, args=(free_port(), job, str(tmp_path), schedule), nprocs=2, start_method="spawn"
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics").read_text().splitlines()]
    decisions = [r for r in records if "batch_schedule" in r]
    assert any(r.get("kind") == "batch_schedule" for r in decisions)  # within an epoch, not at its end alone
    ran = [r["batch_schedule"]["ran"]["global_batch"] for r in decisions]
    assert ran[0] == 32 and len(set(ran)) > 1
    for record, following in zip(decisions, ran[1:] + [None]):
        chosen = record["batch_schedule"]
        assert chosen["b_noise"] > 0 and chosen["global_batch"] == min(
            fastest_to_progress(chosen["b_noise"], latency), 256
        )
        if "kind" not in record:  # an epoch's end: the scale its record holds
            assert chosen["b_noise"] == record["noise_scale"]["b_noise"]
        if following is not None:
            assert following == chosen["next"]["global_batch"] == chosen["global_batch"]
    steps = [r["step"] for r in decisions]
    assert steps == sorted(steps) and steps[-1] == summary["optimizer_steps"]
    assert summary["global_batch"] == ran[-1] and summary["batch_schedule"] == "adaptive"
