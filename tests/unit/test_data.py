"""Real data sets split and sharded over ranks: training shares by DistributedSampler, scoring every image once."""

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import TensorDataset

from tests.conftest import JOB, default_job, job_config
from tula_hpc.config import ConfigError, job_settings, validate_config
from tula_hpc.data import DataError, load_splits, loader_options, loader_workers, make_eval_loader, make_loader

DIGITS = default_job()["data"]


def test_digits_split_is_seeded_disjoint_and_complete():
    a, b = load_splits(DIGITS, seed=1), load_splits(DIGITS, seed=1)
    assert list(a.train.indices) == list(b.train.indices)
    parts = [set(a.train.indices), set(a.val.indices), set(a.test.indices)]
    assert sum(map(len, parts)) == 1797 and len(set.union(*parts)) == 1797
    assert len(a.test) == round(0.2 * 1797)
    assert list(load_splits(DIGITS, seed=2).train.indices) != list(a.train.indices)


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


def test_imagefolder_caltech_layout_is_split_from_real_files(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "eel"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    cfg = {**DIGITS, "name": "imagefolder", "root": str(tmp_path), "image_size": 8}
    splits = load_splits(cfg, seed=0)
    assert (splits.num_classes, splits.in_channels) == (3, 3)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 30
    x, y = splits.train[0]
    assert x.shape == (3, 8, 8)


def test_cifar_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no cifar10 files there"):
        load_splits({**DIGITS, "name": "cifar10", "root": str(tmp_path), "image_size": 32}, seed=0)


def test_loader_workers_default_to_the_cores_of_a_rank_but_the_one_it_trains_on():
    config = job_config()
    del config["jobs"][JOB]["data"]["num_workers"]
    job = job_settings(validate_config(config), JOB)
    assert job["data"]["num_workers"] == "auto"
    assert loader_workers(job) == 0  # one core per rank: loading stays in the training process
    for cores, workers in [(2, 1), (8, 7)]:
        assert loader_workers({**job, "resources": {**job["resources"], "cpus_per_task": cores}}) == workers


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
