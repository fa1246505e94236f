"""The synthetic data set: random images of a given shape, made where they are read, from the seed and positions
alone; its loaders hand over which images, not their pixels."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.conftest import default_job
from tula_hpc.training.datasets import data_shape, load_splits
from tula_hpc.training.loaders import make_loader, on_device, start_epoch
from tula_hpc.training.synthetic import SyntheticBatch, SyntheticImages


def _synthetic_data(image_size: int = 16, train: dict | None = None, **kwargs):
    """A validated job on the synthetic data set with data.kwargs `kwargs`: its data section and its seed."""
    job = default_job(data={"name": "synthetic", "image_size": image_size, "kwargs": kwargs}, train=train or {})
    return job.data, job.train.seed


def test_synthetic_splits_follow_the_fractions_of_its_size():
    data, seed = _synthetic_data(channels=3, classes=7, size=1000)
    for val, test in [(0.1, 0.2), (0.25, 0.15)]:
        splits = load_splits(replace(data, val_fraction=val, test_fraction=test), seed)
        assert (len(splits.val), len(splits.test)) == (round(val * 1000), round(test * 1000))
        parts = [set(part.indices.tolist()) for part in (splits.train, splits.val, splits.test)]
        assert sum(map(len, parts)) == 1000 and set.union(*parts) == set(range(1000))
        assert (splits.shape["num_classes"], splits.shape["in_channels"]) == (7, 3)
    defaults = load_splits(_synthetic_data()[0], seed)  # SYNTHETIC_DEFAULTS: CIFAR-10's training set
    assert (len(defaults.train), len(defaults.val), len(defaults.test)) == (35_000, 5_000, 10_000)
    assert (defaults.shape["num_classes"], defaults.shape["in_channels"]) == (10, 3)


def test_synthetic_images_have_the_shape_asked_for_and_labels_among_the_classes():
    splits = load_splits(*_synthetic_data(image_size=12, channels=2, classes=5, size=300))
    x, y = splits.train[0]
    assert x.shape == (2, 12, 12) and x.dtype == torch.float32 and isinstance(y, int)
    xb, yb = on_device(next(iter(make_loader(splits.train, 64, rank=0, world_size=1, seed=0, shuffle=True))), "cpu")
    assert xb.shape == (64, 2, 12, 12) and yb.dtype == torch.int64
    for part in (splits.train, splits.val, splits.test):
        x, y = part.batch(range(len(part)))
        assert x.shape == (len(part), 2, 12, 12)
        assert set(y.tolist()) <= set(range(5))
    assert set(splits.train.batch(range(len(splits.train)))[1].tolist()) == set(range(5))


def test_synthetic_batches_follow_from_the_seed_and_the_positions():
    """The same positions give the same batch in any process; any other position or seed another."""
    data, seed = _synthetic_data(size=200)
    train, again = load_splits(data, seed).train, load_splits(data, seed).train
    positions = [5, 0, 17, 3]
    x, y = train.batch(positions)
    assert torch.equal(x, again.batch(positions)[0]) and torch.equal(y, again.batch(positions)[1])
    assert torch.equal(x, train.__getitems__(positions).on("cpu")[0])
    # Batches sharing their first image and their length are still different batches.
    assert not torch.equal(train.batch([5, 1])[0][0], train.batch([5, 2])[0][0])
    other = load_splits(*_synthetic_data(size=200, train={"seed": seed + 1})).train
    assert not torch.equal(x, other.batch(positions)[0])

    def made(image_seed):
        return SyntheticImages(np.arange(10), channels=1, image_size=4, classes=2, seed=image_seed).batch([0, 1])

    assert torch.equal(made(3)[0], made(3)[0]) and not torch.equal(made(3)[0], made(4)[0])
    assert torch.equal(made(3)[1], made(4)[1])  # a label is the image's index modulo the classes


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.spawns)])
def test_a_synthetic_loader_hands_over_which_images_and_the_step_makes_them_on_its_device(workers):
    """No pixels cross the loader (nor a worker's pipe): the batch the loop makes of what it hands over is the one
    the data set gives at those positions, and an epoch covers the rank's share of the images once."""
    train = load_splits(*_synthetic_data(size=200)).train
    loader = make_loader(train, 16, rank=1, world_size=2, seed=0, shuffle=True, num_workers=workers)
    start_epoch(loader, 3)
    handed = list(loader)
    assert all(isinstance(batch, SyntheticBatch) for batch in handed)
    first = handed[0]
    x, y = on_device(first, torch.device("cpu"))
    positions = [int(np.flatnonzero(train.indices == image)[0]) for image in first.images]
    assert torch.equal(x, train.batch(positions)[0]) and torch.equal(y, train.batch(positions)[1])
    seen = np.concatenate([batch.images for batch in handed])
    assert len(seen) == len(set(seen.tolist())) == -(-len(train) // 2)


def test_synthetic_batches_are_made_on_the_device_asked_for():
    train = load_splits(*_synthetic_data(size=100)).train
    for device in ("cpu", torch.device("cpu")):
        x, y = train.batch([1, 2, 3], device)
        assert x.device.type == y.device.type == "cpu"
        assert torch.equal(x, train.batch([1, 2, 3])[0])


def test_the_shape_of_synthetic_data_comes_from_its_settings_without_building_images(monkeypatch):
    import tula_hpc.training.datasets as datasets

    jobs = [_synthetic_data(channels=1, classes=4)[0], _synthetic_data()[0]]

    def refuse(*args, **kwargs):
        raise AssertionError("validation built the synthetic images")

    monkeypatch.setattr(datasets, "SyntheticImages", refuse)
    monkeypatch.setitem(datasets.DATA_SETS, "synthetic", refuse)
    assert [(data_shape(job)["num_classes"], data_shape(job)["in_channels"]) for job in jobs] == [(4, 1), (10, 3)]
