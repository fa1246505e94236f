"""How each rank loads its share of a data set (datasets.py): DistributedSampler loaders that can begin an epoch
part-way, their workers and pinned memory, and a batch onto the rank's device.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from torch.utils.data.distributed import DistributedSampler

from tula_hpc.core.job import Job
from tula_hpc.training.datasets import Samples, made_on_device
from tula_hpc.training.synthetic import SyntheticBatch
from tula_hpc.training.tasks import to_device
from tula_hpc.training.text import TokenWindows


def collate(samples):
    """The loaders' collate_fn: a synthetic batch goes on as it is (made on the device by `on_device`), any
    other batch as PyTorch's default collates it."""
    return samples if isinstance(samples, SyntheticBatch) else default_collate(samples)


def on_device(batch, device: torch.device):
    """A loader's batch on the rank's device: a synthetic batch (images or tokens) made there by its `on(device)`,
    any other (a pair or a dict of tensors) copied there (tasks.to_device)."""
    if isinstance(batch, SyntheticBatch):
        return batch.on(device)
    return to_device(batch, device)


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

    Its randomness (the order, the workers' seeds, the augmentation) follows from (seed, epoch) alone, never
    from the global RNG, so a resumed run restores it by position and its RNG checkpoint covers only the steps.
    """
    loader.sampler.start_epoch(epoch, samples_done)
    loader.generator.manual_seed(loader.sampler.seed * 100_003 + epoch)
    if isinstance(loader.dataset, (Samples, TokenWindows)):
        loader.dataset.set_epoch(epoch)


def loader_workers(job: Job) -> int:
    """DataLoader worker processes per rank: `data.num_workers`, or for `auto` one per core of the rank's
    `resources.cpus_per_task` but the one its own process trains on (none with a single core, where a worker
    would only take turns with training on it), and none for synthetic data, which no worker draws (SyntheticBatch)."""
    workers = job.data.num_workers
    if workers != "auto":
        return workers
    return 0 if made_on_device(job.data) else max(0, job.resources.cpus_per_task - 1)


def prefetched_bytes(job: Job, batch_bytes: int) -> int:
    """Host memory a rank's loader holds ahead: PyTorch's default prefetch_factor (2) batches per worker, none for
    batches made on the device."""
    return 0 if made_on_device(job.data) else batch_bytes * 2 * loader_workers(job)


def loader_options(job: Job, device: torch.device) -> dict:
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
        collate_fn=collate,
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
        collate_fn=collate,
    )
