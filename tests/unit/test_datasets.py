"""Real data sets split by seed: digits, an image folder, Debian's Fashion-MNIST files, CIFAR named when missing,
augmentation of training only (alike in any loader worker), users' data-set callables, and bad data named."""

import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import default_job
from tula_hpc.training.data_check import FASHION_MNIST_FILES, FASHION_MNIST_FOLDER, DataError, check_data
from tula_hpc.training.datasets import (
    TensorImages,
    check_samples,
    data_shape,
    digits_arrays,
    fashion_mnist_cache,
    load_splits,
)
from tula_hpc.training.loaders import make_loader, start_epoch
from tula_hpc.training.tasks import ImageClassification

DIGITS = default_job().data


def test_digits_split_is_seeded_disjoint_and_complete():
    a, b = load_splits(DIGITS, seed=1), load_splits(DIGITS, seed=1)
    assert list(a.train.indices) == list(b.train.indices)
    parts = [set(a.train.indices), set(a.val.indices), set(a.test.indices)]
    assert sum(map(len, parts)) == 1797 and len(set.union(*parts)) == 1797
    assert len(a.test) == round(0.2 * 1797)
    assert list(load_splits(DIGITS, seed=2).train.indices) != list(a.train.indices)


def test_imagefolder_caltech_layout_is_split_from_real_files(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "eel"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    cfg = replace(DIGITS, name="imagefolder", root=str(tmp_path), image_size=8)
    splits = load_splits(cfg, seed=0)
    assert (splits.shape["num_classes"], splits.shape["in_channels"]) == (3, 3)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 30
    x, y = splits.train[0]
    assert x.shape == (3, 8, 8)


@pytest.mark.spawns
def test_digits_are_read_as_scikit_learns_loader_reads_them_without_importing_it():
    from sklearn.datasets import load_digits

    images, labels = digits_arrays()
    digits = load_digits()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    assert labels.dtype == np.int64 and images.shape == (1797, 8, 8)
    check = "import sys; from tula_hpc.training.datasets import digits_arrays; digits_arrays(); print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert "sklearn" not in loaded.stdout.split()


def test_cifar_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="field 'data.root': no cifar10 files in"):
        load_splits(replace(DIGITS, name="cifar10", root=str(tmp_path), image_size=32), seed=0)


# --- Fashion-MNIST from Debian's package (`make data` installs it) ------------------------------------------

FASHION = replace(DIGITS, name="fashion_mnist", root=str(FASHION_MNIST_FOLDER), image_size=28)


@pytest.fixture(scope="module")
def fashion(tmp_path_factory):
    """Fashion-MNIST at 28x28, its cache in a folder of its own (as work/data under a run's folder)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("run"))
        return load_splits(FASHION, seed=0)


def test_fashion_mnist_reads_debians_files_and_caches_under_work_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in FASHION_MNIST_FOLDER.iterdir())
    splits = load_splits(replace(FASHION, root=None), seed=0)  # null: Debian's folder
    assert (len(splits.train), len(splits.val), len(splits.test)) == (54_000, 6_000, 10_000)
    assert (splits.shape["num_classes"], splits.shape["in_channels"]) == (10, 1)
    (cache,) = (tmp_path / "work" / "data").iterdir()
    assert cache.name.startswith("fashion_mnist-")
    assert sorted(p.name for p in (cache / "FashionMNIST" / "raw").iterdir()) == sorted(
        name.removesuffix(".gz") for name in FASHION_MNIST_FILES
    )
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in FASHION_MNIST_FOLDER.iterdir()) == before
    again = load_splits(FASHION, seed=0)  # the cache found whole, not built again
    assert list((tmp_path / "work" / "data").iterdir()) == [cache]
    assert torch.equal(again.test[9_999][0], splits.test[9_999][0])


def test_ranks_building_the_cache_at_once_leave_one_whole_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = threading.Barrier(3)

    def build(_):
        start.wait()
        return fashion_mnist_cache(FASHION)

    with ThreadPoolExecutor(3) as pool:
        caches = {tmp_path / cache for cache in pool.map(build, range(3))}
    assert caches == set((tmp_path / "work" / "data").iterdir()) and len(caches) == 1  # no temporary folder left
    raw = caches.pop() / "FashionMNIST" / "raw"
    assert (raw / "train-images-idx3-ubyte").stat().st_size == 16 + 60_000 * 28 * 28


def test_fashion_mnist_images_are_normalised_and_resized(fashion, tmp_path, monkeypatch):
    x, y = fashion.val[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    images = torch.stack([fashion.val[i][0] for i in range(0, 6_000, 3)])
    assert abs(images.mean()) < 0.05 and abs(images.std() - 1) < 0.05  # Fashion-MNIST's own mean and std
    labels = [fashion.test[i][1] for i in range(10_000)]
    assert sorted(set(labels)) == list(range(10)) and labels.count(0) == 1_000
    monkeypatch.chdir(tmp_path)
    small = load_splits(replace(FASHION, image_size=14), seed=0)
    assert small.train[0][0].shape == small.test[0][0].shape == (1, 14, 14)
    assert list(small.val.indices) == list(fashion.val.indices)


def _shifts(augmented: torch.Tensor, plain: torch.Tensor, pad: int, flip: bool) -> list[tuple[int, int, bool]]:
    """The (top, left, mirrored) windows of `plain` zero-padded by `pad` that equal `augmented`."""
    padded = torch.nn.functional.pad(plain, [pad] * 4)
    size = plain.shape[-1]
    found = []
    for top in range(2 * pad + 1):
        for left in range(2 * pad + 1):
            window = padded[:, top : top + size, left : left + size]
            found += [(top, left, False)] if torch.equal(augmented, window) else []
            found += [(top, left, True)] if flip and torch.equal(augmented, window.flip(-1)) else []
    return found


def test_only_training_images_are_augmented_by_the_mnist_recipe(fashion, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = load_splits(replace(FASHION, augment="none"), seed=0)
    assert list(plain.train.indices) == list(fashion.train.indices)
    first = [fashion.train[i][0] for i in range(50)]
    assert all(torch.equal(fashion.train[i][0], first[i]) for i in range(50))  # a function of the epoch, not a draw
    fashion.train.set_epoch(1)
    try:
        moved = sum(not torch.equal(fashion.train[i][0], first[i]) for i in range(50))
        assert moved > 40
        for split in ("val", "test"):
            before = [getattr(plain, split)[i][0] for i in range(50)]
            assert all(torch.equal(getattr(fashion, split)[i][0], before[i]) for i in range(50)), split
    finally:
        fashion.train.set_epoch(0)
    background = (0 - plain.train.mean) / plain.train.std  # black, normalised: what the padding shows
    windows = [_shifts(first[i] - background, plain.train[i][0] - background, pad=4, flip=False) for i in range(50)]
    assert all(windows), "a training image is a window of its zero-padded self"
    assert sum((4, 4, False) not in found for found in windows) > 40  # and most are moved


@pytest.mark.spawns
def test_tensor_augmentation_crops_and_flips_alike_in_any_worker_and_batch():
    """CIFAR's recipe (pad 4, flip) on images held as a tensor: a window of the padded image, mirrored for about
    half; the same one sample by sample, batch by batch, and in a loader worker after start_epoch."""
    images = torch.randint(1, 256, (64, 3, 32, 32), dtype=torch.uint8)
    targets = torch.arange(64) % 10

    def split(augment):
        return TensorImages(
            images,
            targets,
            np.arange(64),
            image_size=32,
            mean_std=((0, 0, 0), (1, 1, 1)),
            pad=4,
            flip=True,
            seed=3,
            augment=augment,
        )

    train, plain = split(True), split(False)
    train.set_epoch(2)
    found = [_shifts(train[i][0] * 255, plain[i][0] * 255, pad=4, flip=True) for i in range(64)]
    assert all(found)
    assert 10 < sum(any(m for _, _, m in f) for f in found) < 54  # about half mirrored
    batch = train.__getitems__(list(range(64)))
    assert all(torch.equal(batch[i][0], train[i][0]) for i in range(64))
    epochs = {}
    for workers in (0, 1):
        loader = make_loader(train, 16, rank=0, world_size=1, seed=0, shuffle=True, num_workers=workers)
        for epoch in (0, 2):
            start_epoch(loader, epoch)
            epochs[workers, epoch] = torch.cat([x for x, _ in loader])
    assert torch.equal(epochs[0, 0], epochs[1, 0]) and torch.equal(epochs[0, 2], epochs[1, 2])
    assert not torch.equal(epochs[0, 0], epochs[0, 2])


def test_imagefolder_augments_training_images_only(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    splits = load_splits(replace(DIGITS, name="imagefolder", root=str(tmp_path), image_size=16), seed=0)
    before = {split: getattr(splits, split)[0][0] for split in ("train", "val", "test")}
    assert torch.equal(splits.train[0][0], before["train"])
    for split in ("train", "val", "test"):
        getattr(splits, split).set_epoch(1)
    assert not torch.equal(splits.train[0][0], before["train"])
    assert torch.equal(splits.val[0][0], before["val"]) and torch.equal(splits.test[0][0], before["test"])


def _fashion_copy(tmp_path, damage) -> str:
    """Debian's folder copied to tmp_path, `damage(folder)` done to the copy."""
    folder = tmp_path / "fashion"
    folder.mkdir()
    for name in FASHION_MNIST_FILES:
        (folder / name).write_bytes((FASHION_MNIST_FOLDER / name).read_bytes())
    damage(folder)
    return str(folder)


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


BAD_FOLDERS = [
    ("no folder", lambda f: shutil.rmtree(f), ["does not exist", "fashion"]),
    ("file missing", lambda f: (f / "t10k-labels-idx1-ubyte.gz").unlink(), ["t10k-labels-idx1-ubyte.gz", "missing"]),
    ("images truncated", lambda f: _truncate(f / "train-images-idx3-ubyte.gz"), ["train-images", "truncated"]),
    ("labels truncated", lambda f: _truncate(f / "t10k-labels-idx1-ubyte.gz", 0.99), ["t10k-labels", "truncated"]),
    ("header only", lambda f: _truncate(f / "train-labels-idx1-ubyte.gz", 0.0001), ["train-labels", "gzip"]),
    (
        "not the file",
        lambda f: (f / "train-images-idx3-ubyte.gz").write_bytes((f / "t10k-labels-idx1-ubyte.gz").read_bytes()),
        ["train-images", "not an idx file of images"],
    ),
]


@pytest.mark.parametrize("label, damage, expected", BAD_FOLDERS, ids=[c[0] for c in BAD_FOLDERS])
def test_a_damaged_fashion_mnist_folder_is_named_with_the_package(label, damage, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = replace(FASHION, root=_fashion_copy(tmp_path, damage))
    for attempt in (check_data, lambda c: load_splits(c, seed=0)):
        with pytest.raises(DataError) as err:
            attempt(cfg)
        message = str(err.value)
        for fragment in ["field 'data.root'", *expected, "dataset-fashion-mnist", "make data"]:
            assert fragment in message, f"{label}: {fragment!r} missing from {message!r}"
    assert not (tmp_path / "work").exists()


def test_a_damaged_stream_with_an_intact_trailer_fails_to_decompress(tmp_path, monkeypatch):
    """The cheap check reads headers and trailers; decompressing (once, into the cache) checks every byte."""
    monkeypatch.chdir(tmp_path)

    def corrupt(folder):
        data = bytearray((folder / "train-images-idx3-ubyte.gz").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / "train-images-idx3-ubyte.gz").write_bytes(bytes(data))

    cfg = replace(FASHION, root=_fashion_copy(tmp_path, corrupt))
    check_data(cfg)
    with pytest.raises(DataError, match="field 'data.root': .*train-images-idx3-ubyte.gz' does not decompress"):
        load_splits(cfg, seed=0)
    assert list((tmp_path / "work" / "data").iterdir()) == []  # no half-built cache left


# --- users' data-set callables -----------------------------------------------------------------------------

USER = replace(DIGITS, image_size=8)


def test_a_data_set_callable_gets_the_arguments_it_names_and_is_split_for_validation():
    splits = load_splits(replace(USER, name="tests.unit.user_datasets:counted", kwargs={"channels": 3}), seed=0)
    assert (splits.shape["num_classes"], splits.shape["in_channels"]) == (3, 3)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (45, 5, 12)
    assert splits.train[0][0].shape == (3, 8, 8)
    named = load_splits(replace(USER, name="tests.unit.user_datasets:with_classes", image_size=6), seed=0)
    assert (named.shape["num_classes"], named.shape["in_channels"], len(named.test)) == (4, 1, 8)
    bare = load_splits(replace(USER, name="tests.unit.user_datasets:without_arguments"), seed=0)
    assert (bare.shape["num_classes"], len(bare.train) + len(bare.val)) == (3, 30)
    assert data_shape(replace(USER, name="tests.unit.user_datasets:with_classes")) == {
        "num_classes": 4,
        "in_channels": 1,
        "image_size": USER.image_size,
    }


BAD_CALLABLES = [
    ("target_outside", "data.name", ["training labels [9]", "4 classes"]),
    ("no_class_count", "data.name", ["no shape", "(train, test, num_classes)", '{"vocab_size": V}']),
    ("one_set", "data.name", ["returned a TensorDataset", "(train, test)"]),
    ("a_dict", "data.name", ["returned a dict", "(train, test)"]),
    ("fails", "data.name", ["raised FileNotFoundError", "/data/mine/train.npz"]),
    ("not_callable", "data.name", ["is not callable"]),
    ("no_such_function", "data.name", ["does not import", "no_such_function"]),
]


@pytest.mark.parametrize("function, field, expected", BAD_CALLABLES, ids=[c[0] for c in BAD_CALLABLES])
def test_a_bad_data_set_callable_is_named_with_the_field(function, field, expected):
    cfg = replace(USER, name=f"tests.unit.user_datasets:{function}")
    for attempt in (check_data, lambda c: load_splits(c, seed=0)):
        with pytest.raises(DataError) as err:
            attempt(cfg)
        message = str(err.value)
        for fragment in [f"field '{field}'", f"user_datasets:{function}", *expected]:
            assert fragment in message, f"{function}: {fragment!r} missing from {message!r}"


BAD_IMAGES = [
    ("flat_images", "data.name", ["training sample 0", "float32 tensor (channels, height, width)"]),
    ("wrong_size", "data.image_size", ["training sample 0", "9x9", "data.image_size is 8"]),
    ("byte_images", "data.name", ["torch.uint8", "float32"]),
    ("label_outside", "data.name", ["training sample 19", "label 3", "3 classes"]),
    ("float_labels", "data.name", ["the label is", "an int"]),
    ("mixed_channels", "data.name", ["test sample 0", "3 channel(s)", "the first training image 1"]),
]


@pytest.mark.parametrize("function, field, expected", BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_a_callables_samples_are_checked_by_the_task(function, field, expected):
    """The samples are the task's to judge (five of each set: the first, the last, some between)."""
    cfg = replace(USER, name=f"tests.unit.user_datasets:{function}")
    check_data(cfg)
    with pytest.raises(DataError) as err:
        check_samples(cfg, ImageClassification())
    message = str(err.value)
    for fragment in [f"field '{field}'", f"user_datasets:{function}", *expected]:
        assert fragment in message, f"{function}: {fragment!r} missing from {message!r}"


def test_good_samples_and_built_in_sets_pass_the_sample_check():
    check_samples(replace(USER, name="tests.unit.user_datasets:counted"), ImageClassification())
    check_samples(DIGITS, ImageClassification())  # built in: nothing loaded
