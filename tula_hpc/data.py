"""Data sets from local files only (nothing is downloaded), seeded splits, DistributedSampler loaders."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CIFAR_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class DataError(RuntimeError):
    """The data set's files are missing or unreadable."""


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    in_channels: int


def _split_indices(n: int, fractions: list[float], seed: int) -> list[np.ndarray]:
    """Seeded permutation cut into consecutive parts; the first part takes the rest."""
    order = np.random.default_rng(seed).permutation(n)
    sizes = [int(round(f * n)) for f in fractions]
    cuts = np.cumsum([n - sum(sizes)] + sizes)[:-1]
    return np.split(order, cuts)


def _digits(cfg: dict, seed: int) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - images.mean()) / images.std()
    if cfg["image_size"] != images.shape[-1]:
        images = torch.nn.functional.interpolate(images, size=cfg["image_size"], mode="bilinear", align_corners=False)
    full = TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))
    train, val, test = _split_indices(len(full), [cfg["val_fraction"], cfg["test_fraction"]], seed)
    return Splits(Subset(full, train), Subset(full, val), Subset(full, test), num_classes=10, in_channels=1)


def _transform(image_size: int, mean_std: tuple, native: int | None):
    from torchvision import transforms as T

    steps = [] if native == image_size else [T.Resize(image_size), T.CenterCrop(image_size)]
    return T.Compose([*steps, T.ToTensor(), T.Normalize(*mean_std)])


def _cifar(cfg: dict, seed: int) -> Splits:
    from torchvision import datasets

    cls, classes = (datasets.CIFAR10, 10) if cfg["name"] == "cifar10" else (datasets.CIFAR100, 100)
    transform = _transform(cfg["image_size"], CIFAR_MEAN_STD, native=32)
    try:
        train_full = cls(cfg["root"], train=True, download=False, transform=transform)
        test = cls(cfg["root"], train=False, download=False, transform=transform)
    except RuntimeError as err:
        raise DataError(f"data.root '{cfg['root']}': no {cfg['name']} files there ({err})") from None
    train, val = _split_indices(len(train_full), [cfg["val_fraction"]], seed)
    return Splits(Subset(train_full, train), Subset(train_full, val), test, classes, 3)


def _imagefolder(cfg: dict, seed: int) -> Splits:
    """ImageNet layout (root/train, root/val) or Caltech layout (root/<class>/...), split by seed."""
    from torchvision import datasets

    root = Path(cfg["root"])
    transform = _transform(cfg["image_size"], IMAGENET_MEAN_STD, native=None)
    load = lambda folder: datasets.ImageFolder(folder, transform=transform, loader=_rgb_loader)  # noqa: E731
    try:
        if (root / "train").is_dir() and (root / "val").is_dir():
            train_full, test = load(root / "train"), load(root / "val")
            train, val = _split_indices(len(train_full), [cfg["val_fraction"]], seed)
            return Splits(Subset(train_full, train), Subset(train_full, val), test, len(train_full.classes), 3)
        full = load(root)
    except (FileNotFoundError, RuntimeError) as err:
        raise DataError(f"data.root '{root}': not an image folder ({err})") from None
    train, val, test = _split_indices(len(full), [cfg["val_fraction"], cfg["test_fraction"]], seed)
    return Splits(Subset(full, train), Subset(full, val), Subset(full, test), len(full.classes), 3)


def _rgb_loader(path: str):
    from PIL import Image

    with open(path, "rb") as handle:
        return Image.open(handle).convert("RGB")


LOADERS = {"digits": _digits, "cifar10": _cifar, "cifar100": _cifar, "imagefolder": _imagefolder}


def load_splits(data_cfg: dict, seed: int) -> Splits:
    return LOADERS[data_cfg["name"]](data_cfg, seed)


class EpochSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way: a run resumed mid-epoch skips the samples it
    already trained on and sees the rest in the order an uninterrupted run would."""

    skip = 0

    def start_epoch(self, epoch: int, samples_done: int = 0) -> None:
        self.set_epoch(epoch)
        self.skip = samples_done

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


def start_epoch(loader: DataLoader, epoch: int, samples_done: int = 0) -> None:
    """Lay out `epoch` of a `make_loader` loader from each rank's `samples_done`-th sample on.

    Its randomness (the order, the workers' seeds) follows from (seed, epoch) alone, never from the global
    RNG, so a resumed run restores it by position and its RNG checkpoint covers only the steps.
    """
    loader.sampler.start_epoch(epoch, samples_done)
    loader.generator.manual_seed(loader.sampler.seed * 100_003 + epoch)


def loader_workers(job: dict) -> int:
    """DataLoader worker processes per rank: `data.num_workers`, or for `auto` one per core of the rank's
    `resources.cpus_per_task` but the one its own process trains on (none with a single core, where a worker
    would only take turns with training on it)."""
    workers = job["data"]["num_workers"]
    return max(0, job["resources"]["cpus_per_task"] - 1) if workers == "auto" else workers


def loader_options(job: dict, device: torch.device) -> dict:
    """How a rank's loaders load: `loader_workers` processes, and on a GPU into pinned (page-locked) memory,
    without which a `non_blocking` copy to the device is a synchronous one."""
    return {"num_workers": loader_workers(job), "pin_memory": device.type == "cuda"}


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool,
    num_workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
) -> DataLoader:
    """Each rank sees its own 1/world_size of the data: DistributedSampler under DDP, as in training."""
    sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=num_workers > 0,
        generator=torch.Generator(),
    )


def make_eval_loader(
    dataset: Dataset, batch_size: int, *, rank: int, world_size: int, num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """Rank r scores images r, r + world_size, ...: every image exactly once, where DistributedSampler would
    pad the ranks' shares to equal length with repeated images and count those twice."""
    return DataLoader(
        Subset(dataset, range(rank, len(dataset), world_size)),
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
