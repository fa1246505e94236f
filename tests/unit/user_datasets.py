"""Data-set callables as users write them (`data.name: tests.unit.user_datasets:NAME`), good ones and bad ones."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


class Labelled(Dataset):
    """Random images with torchvision's `.classes` and `.targets`."""

    def __init__(self, n: int, size: int, classes: int, seed: int = 0, channels: int = 1):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, channels, size, size, generator=generator)
        self.targets = [i % classes for i in range(n)]
        self.classes = [f"class{c}" for c in range(classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def _tensors(n: int, size: int, classes: int = 3, channels: int = 1, seed: int = 0) -> TensorDataset:
    images = torch.rand(n, channels, size, size, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(images, torch.arange(n) % classes)


def counted(image_size: int, n: int = 50, channels: int = 1):
    """Good: plain TensorDatasets and the number of classes; it takes image_size and a data.kwargs key."""
    return _tensors(n, image_size, channels=channels), _tensors(12, image_size, channels=channels, seed=1), 3


def with_classes(image_size: int, root: str | None):
    """Good: the number of classes from the training set's `.classes`; it takes root as well (unused here)."""
    return Labelled(40, image_size, 4), Labelled(8, image_size, 4, seed=1)


def without_arguments():
    """Good, for image_size 8 only: it takes no argument at all."""
    return _tensors(30, 8), _tensors(6, 8), 3


def flat_images(image_size: int):
    images = torch.rand(20, image_size, image_size)
    return TensorDataset(images, torch.arange(20) % 3), TensorDataset(images, torch.arange(20) % 3), 3


def wrong_size(image_size: int):
    return _tensors(20, image_size + 1), _tensors(5, image_size + 1), 3


def byte_images(image_size: int):
    images = torch.zeros(20, 1, image_size, image_size, dtype=torch.uint8)
    return TensorDataset(images, torch.arange(20) % 3), _tensors(5, image_size), 3


def label_outside(image_size: int):
    """The last training label (3) lies outside the 3 classes."""
    train = _tensors(20, image_size)
    train.tensors[1][-1] = 3
    return train, _tensors(5, image_size), 3


def target_outside(image_size: int):
    """One label in the middle, outside the 4 classes: found through `.targets`, not among the samples checked."""
    train = Labelled(40, image_size, 4)
    train.targets[7] = 9
    return train, Labelled(8, image_size, 4, seed=1)


def float_labels(image_size: int):
    images = torch.rand(20, 1, image_size, image_size)
    return TensorDataset(images, torch.zeros(20)), _tensors(5, image_size), 3


def no_class_count(image_size: int):
    return _tensors(20, image_size), _tensors(5, image_size)


def one_set(image_size: int):
    return _tensors(20, image_size)


def a_dict(image_size: int):
    return {"train": _tensors(20, image_size), "test": _tensors(5, image_size)}


def fails(image_size: int):
    raise FileNotFoundError("/data/mine/train.npz")


not_callable = 42
