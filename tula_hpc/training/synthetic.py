"""Synthetic images, made from (seed, indices) on the device a step runs on: what a dry run of a model at its real
input shape needs (memory probes, step times), with no disk, no memory held and no loader worker drawing pixels. The
`synthetic` data set (datasets.py) serves them; the loaders (loaders.py) hand its batches on unmade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class SyntheticBatch:
    """A synthetic batch as its loader hands it over: which images and how they are made, not their pixels, which
    `on` makes on the device the step runs on. No loader worker draws them and nothing is copied to the device:
    a dry run's step is the model's alone (at 224 px a batch of 128 took about 0.16 s of a CPU core to draw and
    collate, more than a GPU step)."""

    images: np.ndarray
    seed: int
    shape: tuple[int, ...]
    classes: int
    vocab: int = 0  # token windows of shape (seq_len,) with ids below vocab, rather than images

    def on(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels (or token windows and their next tokens), made on `device` from the seed and every
        sample's index in order (not the first alone: batches sharing a first image must not share their pixels)."""
        words = np.concatenate([np.array([self.seed % 2**64], dtype=np.uint64), self.images.astype(np.uint64)])
        key = int.from_bytes(hashlib.blake2b(words.tobytes(), digest_size=8).digest(), "little") >> 1
        generator = torch.Generator(device).manual_seed(key)
        if self.vocab:
            tokens = torch.randint(
                self.vocab, (len(self.images), self.shape[0] + 1), generator=generator, device=device
            )
            return tokens[:, :-1], tokens[:, 1:]
        x = torch.randn((len(self.images), *self.shape), generator=generator, device=device)
        labels = torch.from_numpy(self.images % self.classes)
        if torch.device(device).type == "cpu":
            return x, labels
        # From page-locked memory, without waiting: a copy from pageable memory may wait for the steps still queued.
        return x, labels.pin_memory().to(device, non_blocking=True)


class SyntheticImages(Dataset):
    """Images of a fixed shape with labels, made from (seed, indices) where they are used: no disk, no memory held.

    What a dry run of a model at its real input shape needs (memory probes, step times): a step's memory and time
    do not depend on pixel values. A loader reads a batch at a time (`__getitems__`) as a SyntheticBatch, made on
    the rank's device by `on_device`; an image's label is its index modulo the classes."""

    vocab = 0

    def __init__(self, indices, *, channels: int, image_size: int, classes: int, seed: int):
        self.indices, self.seed = np.asarray(indices), seed
        self.shape, self.classes = (channels, image_size, image_size), classes

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        x, y = self.batch([i])
        return x[0], int(y[0])

    def __getitems__(self, positions: list[int]) -> SyntheticBatch:
        images = self.indices[np.asarray(positions, dtype=np.int64)]
        return SyntheticBatch(images, self.seed, self.shape, self.classes, self.vocab)

    def batch(self, positions, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels at `positions`, made on `device`."""
        return self.__getitems__(positions).on(device)


class SyntheticTokens(SyntheticImages):
    """Token windows of seq_len ids below `vocab` and their next tokens, made as SyntheticImages' images are: a
    dry run of a language model at its real context length."""

    def __init__(self, indices, *, vocab: int, seq_len: int, seed: int):
        self.indices, self.seed = np.asarray(indices), seed
        self.shape, self.classes, self.vocab = (seq_len,), vocab, vocab

    def __getitem__(self, i: int):
        x, y = self.batch([i])
        return x[0], y[0]
