"""Real data sets split and sharded over ranks: training shares by DistributedSampler, scoring every image once;
Debian's Fashion-MNIST files, augmentation of training only, the synthetic data set, users' data-set callables,
and bad data named."""

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
from torch.utils.data import TensorDataset

from tests.conftest import JOB, default_job, job_config
from tula_hpc.config import ConfigError, job_settings, validate_config
from tula_hpc.training.data import (
    DataError,
    SyntheticBatch,
    SyntheticImages,
    TensorImages,
    data_shape,
    digits_arrays,
    fashion_mnist_cache,
    load_splits,
    loader_options,
    loader_workers,
    make_eval_loader,
    make_loader,
    on_device,
    prefetched_bytes,
    start_epoch,
)
from tula_hpc.training.data_check import FASHION_MNIST_FILES, FASHION_MNIST_FOLDER, check_data

DIGITS = default_job().data


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
    cfg = replace(DIGITS, name="imagefolder", root=str(tmp_path), image_size=8)
    splits = load_splits(cfg, seed=0)
    assert (splits.num_classes, splits.in_channels) == (3, 3)
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
    check = "import sys; from tula_hpc.training.data import digits_arrays; digits_arrays(); print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert "sklearn" not in loaded.stdout.split()


def test_cifar_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="field 'data.root': no cifar10 files in"):
        load_splits(replace(DIGITS, name="cifar10", root=str(tmp_path), image_size=32), seed=0)


def test_loader_workers_default_to_the_cores_of_a_rank_but_the_one_it_trains_on():
    config = job_config()
    del config["jobs"][JOB]["data"]["num_workers"]
    job = job_settings(validate_config(config), JOB)
    assert job.data.num_workers == "auto"
    assert loader_workers(job) == 0  # one core per rank: loading stays in the training process
    for cores, workers in [(2, 1), (8, 7)]:
        assert loader_workers(job.updated(resources={"cpus_per_task": cores})) == workers
    synthetic = job.updated(data={"name": "synthetic"}, resources={"cpus_per_task": 8})
    assert loader_workers(synthetic) == 0  # its batches are made on the device: nothing for a worker to draw
    assert loader_workers(synthetic.updated(data={"num_workers": 2})) == 2
    # What a loader holds ahead in host memory: two batches a worker, no pixels of batches made on the device.
    assert prefetched_bytes(job.updated(resources={"cpus_per_task": 3}), 100) == 400
    assert prefetched_bytes(synthetic.updated(data={"num_workers": 2}), 100) == 0


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
    assert (splits.num_classes, splits.in_channels) == (10, 1)
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


# --- the synthetic data set: random images of a given shape, made where they are read -------------------------


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
        assert (splits.num_classes, splits.in_channels) == (7, 3)
    defaults = load_splits(_synthetic_data()[0], seed)  # SYNTHETIC_DEFAULTS: CIFAR-10's training set
    assert (len(defaults.train), len(defaults.val), len(defaults.test)) == (35_000, 5_000, 10_000)
    assert (defaults.num_classes, defaults.in_channels) == (10, 3)


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


def test_an_ordinary_batch_is_copied_to_the_device_as_it_is():
    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0])
    moved = on_device((x, y), torch.device("cpu"))
    assert torch.equal(moved[0], x) and torch.equal(moved[1], y)


def test_synthetic_batches_are_made_on_the_device_asked_for():
    train = load_splits(*_synthetic_data(size=100)).train
    for device in ("cpu", torch.device("cpu")):
        x, y = train.batch([1, 2, 3], device)
        assert x.device.type == y.device.type == "cpu"
        assert torch.equal(x, train.batch([1, 2, 3])[0])


def test_the_shape_of_synthetic_data_comes_from_its_settings_without_building_images(monkeypatch):
    import tula_hpc.training.data as data

    jobs = [_synthetic_data(channels=1, classes=4)[0], _synthetic_data()[0]]

    def refuse(*args, **kwargs):
        raise AssertionError("validation built the synthetic images")

    monkeypatch.setattr(data, "SyntheticImages", refuse)
    monkeypatch.setitem(data.LOADERS, "synthetic", refuse)
    assert [data_shape(job) for job in jobs] == [(4, 1), (10, 3)]


# --- users' data-set callables -----------------------------------------------------------------------------

USER = replace(DIGITS, image_size=8)


def test_a_data_set_callable_gets_the_arguments_it_names_and_is_split_for_validation():
    splits = load_splits(replace(USER, name="tests.unit.user_datasets:counted", kwargs={"channels": 3}), seed=0)
    assert (splits.num_classes, splits.in_channels) == (3, 3)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (45, 5, 12)
    assert splits.train[0][0].shape == (3, 8, 8)
    named = load_splits(replace(USER, name="tests.unit.user_datasets:with_classes", image_size=6), seed=0)
    assert (named.num_classes, named.in_channels, len(named.test)) == (4, 1, 8)
    bare = load_splits(replace(USER, name="tests.unit.user_datasets:without_arguments"), seed=0)
    assert (bare.num_classes, len(bare.train) + len(bare.val)) == (3, 30)
    assert data_shape(replace(USER, name="tests.unit.user_datasets:with_classes")) == (4, 1)


BAD_CALLABLES = [
    ("flat_images", "data.name", ["training sample 0", "float32 tensor (channels, height, width)"]),
    ("wrong_size", "data.image_size", ["9x9", "data.image_size is 8"]),
    ("byte_images", "data.name", ["torch.uint8", "float32"]),
    ("label_outside", "data.name", ["training sample 19", "label 3", "3 classes"]),
    ("target_outside", "data.name", ["training labels [9]", "4 classes"]),
    ("float_labels", "data.name", ["the label is", "an int"]),
    ("no_class_count", "data.name", ["no num_classes", "(train, test, num_classes)"]),
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
