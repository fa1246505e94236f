"""validation.py: the fixed subset validation scores, and the steps that validate mid-epoch."""

import torch
from torch.utils.data import TensorDataset

from tests.conftest import default_job
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
    every3 = default_job(train=dict(val_every_steps=3)).train
    assert [s for s in range(1, 10) if validation_due(every3, s, (0, 0), epoch_over=False)] == [3, 6, 9]
    assert not validation_due(every3, 6, (0, 0), epoch_over=True)
    assert not validation_due(default_job().train, 6, (0, 10**6), epoch_over=False)


def test_validation_falls_where_the_tokens_cross_a_multiple_whatever_the_batch_and_once_where_both_fall_due():
    tokens = default_job(train=dict(val_every_tokens=100, val_every_steps=2)).train
    # steps of 30 tokens, then of 120 (the batch changed): 90 -> 120 crosses 100, 120 -> 240 crosses 200
    places = [(0, 30), (30, 60), (60, 90), (90, 120), (120, 240), (240, 250)]
    due = [validation_due(tokens, step, place, epoch_over=False) for step, place in enumerate(places, start=1)]
    assert due == [False, True, False, True, True, True]
