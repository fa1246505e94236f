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


def mixed_channels(image_size: int):
    """The test set's images have 3 channels, the training set's 1."""
    return _tensors(20, image_size), _tensors(5, image_size, channels=3), 3


# --- token windows, for causal_lm: data.seq_len 8 and a vocabulary of 11 ids -------------------------------------


class Windows(Dataset):
    """Windows of `seq_len` tokens of a counting sequence modulo `vocab`: pairs (x, y), y shifted by one token, or
    Hugging Face's dicts {input_ids, labels} (labels aligned with input_ids)."""

    def __init__(self, n: int, seq_len: int, vocab: int, as_dict: bool = False, top: int | None = None):
        self.tokens = (torch.arange(n + seq_len + 1) % vocab).long()
        self.n, self.seq_len, self.as_dict, self.top = n, seq_len, as_dict, top

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        window = self.tokens[i : i + self.seq_len + 1].clone()
        if self.top is not None and i == self.n - 1:
            window[0] = self.top  # the last sample holds an id outside the vocabulary
        if self.as_dict:
            return {"input_ids": window[:-1], "labels": window[:-1].clone()}
        return window[:-1], window[1:]


def token_pairs(seq_len: int = 8, vocab: int = 11):
    """Good: (x, y) int64 windows and the vocabulary's size."""
    return Windows(40, seq_len, vocab), Windows(10, seq_len, vocab), {"vocab_size": vocab}


def token_dicts(seq_len: int = 8, vocab: int = 11):
    """Good: Hugging Face style dicts {input_ids, labels}."""
    return Windows(40, seq_len, vocab, as_dict=True), Windows(10, seq_len, vocab, as_dict=True), {"vocab_size": vocab}


def token_outside(seq_len: int = 8, vocab: int = 11):
    """The last training window holds id 11, outside the 11 ids."""
    return Windows(40, seq_len, vocab, top=vocab), Windows(10, seq_len, vocab), {"vocab_size": vocab}


def token_shape_not_counted():
    return Windows(40, 8, 11), Windows(10, 8, 11), {"vocab_size": 0}
