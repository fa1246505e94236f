"""Loaders over ranks: training shares by DistributedSampler, scoring every image once, workers per core, pinned
memory for a GPU, and a batch onto the device."""

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.conftest import JOB, default_job, job_config
from tula_hpc.config import ConfigError, job_settings, validate_config
from tula_hpc.training.datasets import load_splits
from tula_hpc.training.loaders import (
    loader_options,
    loader_workers,
    make_eval_loader,
    make_loader,
    on_device,
    prefetched_bytes,
)

DIGITS = default_job().data


def test_distributed_loaders_give_each_rank_its_own_share():
    splits = load_splits(DIGITS, seed=0)
    seen = [set() for _ in range(2)]
    for rank in range(2):
        loader = make_loader(splits.train, 64, rank=rank, world_size=2, seed=0, shuffle=True)
        seen[rank] = {tuple(x.flatten().tolist()) for xb, _ in loader for x in xb}
    assert len(seen[0] & seen[1]) < 5  # disjoint up to duplicate images in the data set


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_evaluation_shards_are_disjoint_and_together_every_image_once(world_size):
    # 7 images: DistributedSampler would pad 2, 3 or 4 ranks to equal shares by repeating some.
    images = TensorDataset(torch.arange(7))
    shards = [
        [int(i) for (batch,) in make_eval_loader(images, 2, rank=rank, world_size=world_size) for i in batch]
        for rank in range(world_size)
    ]
    assert sorted(sum(shards, [])) == list(range(7))
    assert [len(s) for s in shards] == [len(range(rank, 7, world_size)) for rank in range(world_size)]


def test_loader_workers_default_to_the_cores_of_a_rank_but_the_one_it_trains_on():
    config = job_config()
    del config["jobs"][JOB]["data"]["num_workers"]
    job = job_settings(validate_config(config), JOB)
    assert job.data.num_workers == "auto"
    assert loader_workers(job) == 0  # one core per rank: loading stays in the training process
    for cores, workers in [(2, 1), (8, 7)]:
        assert loader_workers(job.updated(resources={"cpus_per_task": cores})) == workers
    synthetic = job.updated(data={"name": "synthetic"}, resources={"cpus_per_task": 8})
    assert loader_workers(synthetic) == 0  # its batches are made on the device: nothing for a worker to draw
    assert loader_workers(synthetic.updated(data={"num_workers": 2})) == 2
    # What a loader holds ahead in host memory: two batches a worker, no pixels of batches made on the device.
    assert prefetched_bytes(job.updated(resources={"cpus_per_task": 3}), 100) == 400
    assert prefetched_bytes(synthetic.updated(data={"num_workers": 2}), 100) == 0


@pytest.mark.parametrize("workers", [0, 3])
def test_a_number_of_loader_workers_wins_over_the_cores(workers):
    assert loader_workers(default_job(data={"num_workers": workers}, resources={"cpus_per_task": 8})) == workers


def test_loader_workers_are_a_count_or_auto():
    with pytest.raises(ConfigError, match="num_workers"):
        validate_config(job_config(data={"num_workers": "all"}))


def test_batches_are_pinned_for_a_gpu_only():
    """Pinned batches make the non-blocking copy to a GPU asynchronous; on the CPU there is nothing to copy."""
    job, splits = default_job(), load_splits(DIGITS, seed=0)
    for device, pinned in [("cpu", False), ("cuda", True)]:
        options = loader_options(job, torch.device(device))
        assert options == {"num_workers": 0, "pin_memory": pinned}
        assert make_loader(splits.train, 8, rank=0, world_size=1, seed=0, shuffle=True, **options).pin_memory == pinned
        assert make_eval_loader(splits.test, 8, rank=0, world_size=1, **options).pin_memory == pinned


def test_an_ordinary_batch_is_copied_to_the_device_as_it_is():
    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0])
    moved = on_device((x, y), torch.device("cpu"))
    assert torch.equal(moved[0], x) and torch.equal(moved[1], y)
