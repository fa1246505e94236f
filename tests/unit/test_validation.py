"""validation.py: the fixed subset validation scores, and the steps that validate mid-epoch."""

import torch
from torch.utils.data import TensorDataset

from tula_hpc.training.validation import validation_due, validation_subset


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _indices(subset) -> list[int]:
    return [int(subset[i][0]) for i in range(len(subset))]


def test_the_subset_is_the_same_seeded_draw_at_every_validation_and_in_the_split_s_order():
    dataset = _dataset(100)
    first, again = (validation_subset(dataset, 10, seed=3) for _ in range(2))
    assert len(first) == 10 and _indices(first) == _indices(again) == sorted(_indices(first))
    assert _indices(validation_subset(dataset, 10, seed=4)) != _indices(first)


def test_no_subset_or_one_as_large_as_the_split_is_the_whole_split():
    dataset = _dataset(20)
    assert validation_subset(dataset, None, seed=0) is dataset
    assert validation_subset(dataset, 20, seed=0) is dataset


def test_validation_falls_every_n_steps_but_not_where_the_epoch_ends_which_validates_anyway():
    assert [s for s in range(1, 10) if validation_due(3, s, epoch_over=False)] == [3, 6, 9]
    assert not validation_due(3, 6, epoch_over=True)
    assert not validation_due(None, 6, epoch_over=False)
