"""The data sets, from local files only (nothing is downloaded): seeded train/val/test splits and training's
augmentation, drawn from (seed, epoch, image) alone. Built in: sklearn's digits, Fashion-MNIST, CIFAR-10/100, an
image folder, synthetic images (synthetic.py); any other data.name is a user's callable (data_check.py checks it).
A new data set (a text corpus) is a builder in `DATA_SETS`, its Dataset classes in a module of their own as
synthetic.py's are; how ranks load its batches is loaders.py's.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from tula_hpc.core.job import DataSettings
from tula_hpc.training.data_check import (
    FASHION_MNIST_HINT,
    SAMPLES_CHECKED,
    TEXT_SHAPE_KEYS,
    DataError,
    builtin_shape_keys,
    fashion_mnist_files,
    image_shape,
    user_data_sets,
)
from tula_hpc.training.synthetic import SyntheticImages, SyntheticTokens
from tula_hpc.training.tasks import Task, TaskError
from tula_hpc.training.text import text_shape, text_splits

CIFAR_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
FASHION_MNIST_MEAN_STD = ((0.2860,), (0.3530,))
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# What is derived from a user's data (decompressed files) lives here, under the folder the workflow runs in
# (Snakemake's working directory, where stages and Slurm jobs run), as work/{job} does; never beside the data.
CACHE_DIR = Path("work") / "data"


@dataclass
class Splits:
    """A data set's three parts and its shape: the keyword arguments its model is built with (`data_shape`)."""

    train: Dataset
    val: Dataset
    test: Dataset
    shape: dict


def _split_indices(n: int, fractions: list[float], seed: int) -> list[np.ndarray]:
    """Seeded permutation cut into consecutive parts; the first part takes the rest."""
    order = np.random.default_rng(seed).permutation(n)
    sizes = [int(round(f * n)) for f in fractions]
    cuts = np.cumsum([n - sum(sizes)] + sizes)[:-1]
    return np.split(order, cuts)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: 64 well-mixed bits from any 64 (uint64 arrays wrap around, as it needs)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Samples(Dataset):
    """Images `indices` of a data set; with `augment`, training's random crops and flips.

    Their randomness is drawn from (seed, epoch, image) alone, never from a process's RNG: the same in any
    loader worker, for any number of ranks, and in a run resumed mid-epoch. The epoch lives in shared memory,
    where persistent loader workers see what `start_epoch` sets."""

    def __init__(self, indices, *, seed: int, augment: bool):
        self.indices, self.seed, self.augment = np.asarray(indices), seed, augment
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def draws(self, images: np.ndarray) -> np.ndarray:
        """64 random bits (uint64) for each of `images` in this epoch."""
        key = _mix(_mix(np.array([self.seed % 2**64], dtype=np.uint64)) ^ np.uint64(int(self.epoch)))
        return _mix(key ^ images.astype(np.uint64))


class TensorImages(Samples):
    """Images held as one uint8 tensor (N, C, H, W), served a batch at a time (`__getitems__`, which the
    DataLoader calls): no PIL and no per-sample work. Augmentation is a random crop after padding `pad` pixels
    (and a horizontal flip with `flip`) at the data set's own size, before resizing to `image_size`, so the
    padding scales with the image: 4 of 28 pixels at 28 or at 14."""

    def __init__(self, images, targets, indices, *, image_size, mean_std, pad, flip, seed, augment):
        super().__init__(indices, seed=seed, augment=augment)
        self.images, self.targets = images, targets.tolist()
        self.image_size, self.pad, self.flip = image_size, pad, flip
        self.mean, self.std = (torch.tensor(v).view(-1, 1, 1) for v in mean_std)

    def __getitem__(self, i: int):
        x, y = self._batch([i])
        return x[0], y[0]

    def __getitems__(self, positions: list[int]) -> list:
        x, y = self._batch(positions)
        return list(zip(x.unbind(0), y))

    def _batch(self, positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        images = self.indices[positions]
        x = self.images[torch.from_numpy(images)]
        if self.augment:
            x = self._crop_and_flip(x, self.draws(images))
        x = x.float().div_(255)
        if x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=self.image_size, mode="bilinear", antialias=True, align_corners=False)
        return (x - self.mean) / self.std, [self.targets[j] for j in images]

    def _crop_and_flip(self, x: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
        """Each image's window of its zero-padded self, mirrored with `flip` when bit 32 is set: one gather."""
        n, channels, height, width = x.shape
        side, padded_width = np.uint64(2 * self.pad + 1), width + 2 * self.pad
        top = torch.from_numpy((bits % side).astype(np.int64))
        left = torch.from_numpy(((bits >> np.uint64(16)) % side).astype(np.int64))
        rows = top[:, None] + torch.arange(height)
        cols = left[:, None] + torch.arange(width)
        if self.flip:
            mirrored = torch.from_numpy((bits >> np.uint64(32) & np.uint64(1)).astype(bool))
            cols = torch.where(mirrored[:, None], cols.flip(-1), cols)
        where = (rows[:, :, None] * padded_width + cols[:, None, :]).view(n, 1, -1).expand(n, channels, -1)
        padded = F.pad(x, [self.pad] * 4).view(n, channels, -1)
        return padded.gather(2, where).view(n, channels, height, width)


def _tensor_splits(train, test, cfg: DataSettings, seed: int, *, num_classes: int, **recipe) -> Splits:
    """Train/val/test of a data set held as ((images, targets), (images, targets)); val is carved from train by
    seed, and only train is augmented (`recipe`: mean_std, pad, flip)."""
    train_indices, val_indices = _split_indices(len(train[1]), [cfg.val_fraction], seed)
    augment = cfg.augment == "standard"

    def part(data, indices, augmented):
        return TensorImages(*data, indices, image_size=cfg.image_size, seed=seed, augment=augmented, **recipe)

    return Splits(
        part(train, train_indices, augment),
        part(train, val_indices, False),
        part(test, np.arange(len(test[1])), False),
        image_shape(num_classes, train[0].shape[1], cfg),
    )


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (images, labels) as its load_digits reads them, from the file it ships, found
    without importing scikit-learn: that import took 1.4 s of every worker's start here (probe, profiles, training,
    evaluation), for a 1,797-row CSV."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        raise DataError(f"field 'data.name': digits are read from scikit-learn's digits.csv.gz, not found at {path}")
    with gzip.open(path, "rt") as rows:
        data = np.loadtxt(rows, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The 8x8 digits as the `digits` data set trains on them: images (N, 1, 8, 8) scaled to zero mean and unit
    variance, and their labels."""
    pixels, labels = digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    return (images - images.mean()) / images.std(), torch.from_numpy(labels)


def _digits(cfg: DataSettings, seed: int) -> Splits:
    """sklearn's 8x8 digits, never augmented (see data.augment in the schema)."""
    images, labels = digits_tensors()
    if cfg.image_size != images.shape[-1]:
        images = torch.nn.functional.interpolate(images, size=cfg.image_size, mode="bilinear", align_corners=False)
    full = TensorDataset(images, labels)
    train, val, test = _split_indices(len(full), [cfg.val_fraction, cfg.test_fraction], seed)
    return Splits(Subset(full, train), Subset(full, val), Subset(full, test), image_shape(10, 1, cfg))


SYNTHETIC_DEFAULTS = {"channels": 3, "classes": 10, "size": 50_000}


def synthetic_settings(cfg: DataSettings) -> dict:
    """data.kwargs of the synthetic data set over its defaults (SYNTHETIC_DEFAULTS: CIFAR-10's training set)."""
    return {**SYNTHETIC_DEFAULTS, **cfg.kwargs}


def _synthetic(cfg: DataSettings, seed: int) -> Splits:
    settings = synthetic_settings(cfg)
    train, val, test = _split_indices(settings["size"], [cfg.val_fraction, cfg.test_fraction], seed)
    if "vocab" in settings:
        tokens = {"vocab": settings["vocab"], "seq_len": cfg.seq_len, "seed": seed}
        return Splits(*(SyntheticTokens(part, **tokens) for part in (train, val, test)), text_shape(cfg))
    shape = {"channels": settings["channels"], "image_size": cfg.image_size, "classes": settings["classes"]}
    return Splits(
        *(SyntheticImages(part, seed=seed, **shape) for part in (train, val, test)),
        image_shape(settings["classes"], settings["channels"], cfg),
    )


def fashion_mnist_cache(cfg: DataSettings) -> Path:
    """A folder where torchvision's FashionMNIST finds the files: data.root's .gz files decompressed once into
    CACHE_DIR/fashion_mnist-<key>/FashionMNIST/raw, the key from the files' paths, sizes and mtimes.

    Built in a temporary folder and renamed into place, so ranks and probes starting together each either
    build it or find it whole."""
    files = fashion_mnist_files(cfg)
    stats = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    cache = CACHE_DIR / f"fashion_mnist-{hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]}"
    if cache.is_dir():
        return cache
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=CACHE_DIR))
    try:
        raw = building / "FashionMNIST" / "raw"
        raw.mkdir(parents=True)
        for path, size in files.items():
            try:
                data = gzip.decompress(path.read_bytes())
            except (OSError, EOFError, zlib.error) as err:
                raise DataError(
                    f"field 'data.root': '{path}' does not decompress ({err}); {FASHION_MNIST_HINT}"
                ) from None
            if len(data) != size:
                raise DataError(
                    f"field 'data.root': '{path}' decompresses to {len(data)} bytes, its header announces {size}; "
                    f"{FASHION_MNIST_HINT}"
                )
            (raw / path.stem).write_bytes(data)
        try:
            building.rename(cache)
        except OSError:  # another process renamed its copy first
            if not cache.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return cache


def _fashion_mnist(cfg: DataSettings, seed: int) -> Splits:
    """Fashion-MNIST; standard augmentation is the MNIST family's: a random crop after padding 4 pixels."""
    from torchvision.datasets import FashionMNIST

    cache = fashion_mnist_cache(cfg)
    train, test = (FashionMNIST(str(cache), train=split, download=False) for split in (True, False))
    return _tensor_splits(
        (train.data.unsqueeze(1), train.targets),
        (test.data.unsqueeze(1), test.targets),
        cfg,
        seed,
        num_classes=len(train.classes),
        mean_std=FASHION_MNIST_MEAN_STD,
        pad=4,
        flip=False,
    )


def _cifar(cfg: DataSettings, seed: int) -> Splits:
    """CIFAR-10/100; standard augmentation is a random crop after padding 4 pixels and a horizontal flip."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if cfg.name == "cifar10" else datasets.CIFAR100
    try:
        train, test = (cls(cfg.root, train=split, download=False) for split in (True, False))
    except RuntimeError as err:
        raise DataError(f"field 'data.root': no {cfg.name} files in '{cfg.root}' ({err})") from None

    def held(split):
        return torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(split.targets)

    return _tensor_splits(
        held(train), held(test), cfg, seed, num_classes=len(train.classes), mean_std=CIFAR_MEAN_STD, pad=4, flip=True
    )


class FileImages(Samples):
    """Images of an ImageFolder, decoded per sample. Training's augmentation is the ImageNet recipe
    (RandomResizedCrop, horizontal flip), under torch's RNG seeded by `draws`; otherwise the short side is
    resized and the centre cropped."""

    def __init__(self, folder, indices, *, image_size: int, seed: int, augment: bool):
        from torchvision import transforms as T

        super().__init__(indices, seed=seed, augment=augment)
        self.folder = folder
        steps = (
            [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
            if augment
            else [T.Resize(image_size), T.CenterCrop(image_size)]
        )
        self.transform = T.Compose([*steps, T.ToTensor(), T.Normalize(*IMAGENET_MEAN_STD)])

    def __getitem__(self, i: int):
        j = int(self.indices[i])
        image, label = self.folder[j]
        if not self.augment:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.draws(np.array([j]))[0]))
            return self.transform(image), label


def _imagefolder(cfg: DataSettings, seed: int) -> Splits:
    """ImageNet layout (root/train, root/val) or Caltech layout (root/<class>/...), split by seed."""
    from torchvision import datasets

    root = Path(cfg.root)
    load = lambda folder: datasets.ImageFolder(folder, loader=_rgb_loader)  # noqa: E731
    try:
        if (root / "train").is_dir() and (root / "val").is_dir():
            train_full, test_full = load(root / "train"), load(root / "val")
            train, val = _split_indices(len(train_full), [cfg.val_fraction], seed)
            test = np.arange(len(test_full))
        else:
            train_full = test_full = load(root)
            train, val, test = _split_indices(len(train_full), [cfg.val_fraction, cfg.test_fraction], seed)
    except (FileNotFoundError, RuntimeError) as err:
        raise DataError(f"field 'data.root': '{root}' is not an image folder ({err})") from None

    def part(folder, indices, augment):
        return FileImages(folder, indices, image_size=cfg.image_size, seed=seed, augment=augment)

    return Splits(
        part(train_full, train, cfg.augment == "standard"),
        part(train_full, val, False),
        part(test_full, test, False),
        image_shape(len(train_full.classes), 3, cfg),
    )


def _rgb_loader(path: str):
    from PIL import Image

    with open(path, "rb") as handle:
        return Image.open(handle).convert("RGB")


def _text(cfg: DataSettings, seed: int) -> Splits:
    return Splits(*text_splits(cfg, seed))


def _user(cfg: DataSettings, seed: int) -> Splits:
    """A `package.module:callable` data set (see data_check.user_data_sets), used as given: no augmentation."""
    train, test, shape = user_data_sets(cfg)
    train_indices, val_indices = _split_indices(len(train), [cfg.val_fraction], seed)
    return Splits(Subset(train, train_indices), Subset(train, val_indices), test, shape)


def check_samples(data: DataSettings, task: Task) -> None:
    """Raise DataError unless SAMPLES_CHECKED samples of each set of a user's data set (the first, the last and some
    between) fit the job's task: what validation checks before anything is submitted. Built-in sets fit by design."""
    if builtin_shape_keys(data) is not None:
        return
    train, test, shape = user_data_sets(data)
    for part, dataset in (("training", train), ("test", test)):
        n = len(dataset)
        for i in sorted({round(k * (n - 1) / (SAMPLES_CHECKED - 1)) for k in range(SAMPLES_CHECKED)}):
            where = f"'{data.name}': {part} sample {i}"
            try:
                sample = dataset[i]
            except Exception as err:  # the user's code: whatever it raises is theirs to read
                raise DataError(f"field 'data.name': {where}: raised {type(err).__name__}: {err}") from None
            try:
                task.check_sample(sample, shape)
            except TaskError as err:
                raise DataError(f"field '{err.field}': {where}: {err}") from None


# The registry of data.name: each built-in data set's builder; any other name is a user's `package.module:callable`
# (the schema's enum is checked against it by a test).
DATA_SETS = {
    "digits": _digits,
    "fashion_mnist": _fashion_mnist,
    "cifar10": _cifar,
    "cifar100": _cifar,
    "imagefolder": _imagefolder,
    "synthetic": _synthetic,
    "shakespeare": _text,
    "tokens": _text,
}


def load_splits(data: DataSettings, seed: int) -> Splits:
    return DATA_SETS.get(data.name, _user)(data, seed)


def made_on_device(data: DataSettings) -> bool:
    """Whether the data set's batches are made on the rank's device (SyntheticBatch): its loader holds no pixels."""
    return data.name == "synthetic"


# (num_classes, in_channels) of the built-in image data sets of a fixed shape.
DATA_SHAPES = {"digits": (10, 1), "fashion_mnist": (10, 1), "cifar10": (10, 3), "cifar100": (100, 3)}


def data_shape(data: DataSettings) -> dict:
    """A data set's shape without loading its samples: the keyword arguments its model is built with (an image
    classifier's num_classes, in_channels and image_size; a language model's vocab_size and seq_len), what
    validation builds the model for. A user's callable says it with its sets (data_check.user_data_sets).

    An imagefolder's classes are its class folders (as torchvision's ImageFolder counts them), its images RGB."""
    name, keys = data.name, builtin_shape_keys(data)
    if keys is None:
        return user_data_sets(data)[2]
    if keys == TEXT_SHAPE_KEYS:
        return text_shape(data)
    if name == "imagefolder":
        root = Path(data.root)
        folder = root / "train" if (root / "train").is_dir() and (root / "val").is_dir() else root
        return image_shape(sum(entry.is_dir() for entry in folder.iterdir()), 3, data)
    if name in DATA_SHAPES:
        return image_shape(*DATA_SHAPES[name], data)
    settings = synthetic_settings(data)
    return image_shape(settings["classes"], settings["channels"], data)
