"""A user's data set behind a slow file system, for bench/loader_pace.py: the 8x8 digits repeated to `size` images,
each read after `latency_ms` (a network file system's round trip), as a `package.module:callable` data set (data.name
`tula_bench.slow_storage:digits_behind_latency`, with bench/ on PYTHONPATH)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

from tula_hpc.training.datasets import digits_tensors

TEST_SHARE = 0.2


class ImagesBehindLatency(Dataset):
    """Images held in memory, each read as if from storage `latency_s` away."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, latency_s: float):
        self.images, self.labels, self.latency_s = images, labels, latency_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        time.sleep(self.latency_s)
        return self.images[i], int(self.labels[i])


def digits_behind_latency(image_size: int, latency_ms: float = 0.0, size: int = 1797):
    """(train, test, 10): the digits as the built-in `digits` normalises them, repeated to `size` images, each
    `latency_ms` away."""
    if image_size != 8:
        raise ValueError(f"image_size {image_size}: the digits are 8x8 here")
    images, labels = digits_tensors()
    images, labels = (
        images.repeat(-(-size // len(labels)), 1, 1, 1)[:size],
        labels.repeat(-(-size // len(labels)))[:size],
    )
    cut = int(len(labels) * (1 - TEST_SHARE))
    latency_s = latency_ms / 1000
    return (
        ImagesBehindLatency(images[:cut], labels[:cut], latency_s),
        ImagesBehindLatency(images[cut:], labels[cut:], latency_s),
        10,
    )
