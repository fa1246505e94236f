"""epochs: a run's predicted epochs and the measured ones against them, on rows with known answers."""

import pytest

from tula_hpc.performance.epochs import compare_epochs, epoch_times, restarts, run_time


def test_epochs_carry_the_warm_up_where_training_pays_it():
    row = {"epoch_s": 1.0, "epoch_start_s": 0.1, "warmup_first_s": 2.0, "warmup_second_s": 0.5}
    assert epoch_times(row, 4) == pytest.approx([2.9, 1.5, 1.0, 1.0])
    assert epoch_times(row, 1) == pytest.approx([2.9])
    assert epoch_times({"epoch_s": 1.0}, 2) == [1.0, 1.0]  # a row of steps only
    assert [restarts(e) for e in (0.5, 1.0, 2.2, 3.0)] == [0, 0, 2, 2]


def test_the_first_epoch_and_the_steady_ones_are_compared_apart():
    compared = compare_epochs([3.0, 1.6, 1.1, 0.9], [2.9, 1.5, 1.0, 1.0])
    assert compared["first_epoch_rel_error"] == pytest.approx(-0.1 / 3.0)
    assert compared["measured_steady_epoch_s"] == pytest.approx(1.0)  # from the third epoch on
    assert compared["steady_epoch_rel_error"] == pytest.approx(0.0)
    two = compare_epochs([3.0, 1.2], [2.9, 1.5])
    assert two["steady_epoch_rel_error"] == pytest.approx(0.25)


def test_a_part_run_last_epoch_pays_its_start_and_warm_up_and_its_share_of_the_steps():
    row = {"epoch_s": 1.0, "epoch_start_s": 0.1, "warmup_first_s": 2.0, "warmup_second_s": 0.5}
    assert run_time(row, 4) == pytest.approx(sum(epoch_times(row, 4)))
    assert run_time(row, 0.5) == pytest.approx(2.0 + 0.5 * 0.9)  # half the first epoch's steps, all its warm-up
    assert run_time(row, 2.5) == pytest.approx(2.9 + 1.5 + 0.1 + 0.5 * 0.9)
