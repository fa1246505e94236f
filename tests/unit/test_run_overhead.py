"""run_overhead: the warm-up and epoch-end terms from profiles, on synthetic profiles with known answers."""

import numpy as np
import pytest

from tula_hpc.performance.run_overhead import (
    TERMS,
    RunOverheads,
    compare_epochs,
    epoch_times,
    fit_overheads,
    profile_terms,
    restarts,
)


def _profile(ranks: int, batch: int, step: float, warmup: list[float] | None, start: float = 0.0) -> dict:
    profile = {"world_size": ranks, "per_device_batch": batch, "ranks_per_host": ranks, "median": {"step_s": step}}
    if warmup is not None:
        profile["warmup_step_s"] = warmup
        profile["epoch_ends"] = {
            "last_step_s": [step, step],
            "strategy_end_s": [0.0, 0.0],
            "start_s": [step + 2 * start, step + start],
            "validation_s": [0.2 / ranks, 0.2 / ranks],
            "checkpoint_s": 0.1,
        }
    return profile


def test_a_profile_measures_each_term_from_its_own_timings():
    profile = _profile(1, 32, 0.1, [2.0, 0.15, 0.1], start=0.05)
    profile["epoch_ends"]["last_step_s"] = [0.3, 0.08]
    terms = profile_terms(profile)
    assert terms["warmup_first_s"] == pytest.approx(1.9 + 0.05 + 0.22)  # the steps' excess, the last step's first time
    assert terms["warmup_second_s"] == pytest.approx(0.05)
    assert terms["epoch_start_s"] == pytest.approx(0.05)
    assert terms["outside_epoch_s"] == pytest.approx(0.3)
    assert profile_terms(_profile(1, 32, 0.1, None)) == {}  # recorded before they were timed


def test_terms_are_measured_where_profiled_and_follow_the_step_and_the_ranks_elsewhere():
    # warm-up W_1 = 0.5 + 3 x step, validation 0.2 / ranks + checkpoint 0.1
    shapes = [(1, 8, 0.1), (1, 32, 0.2), (2, 32, 0.4), (4, 32, 0.8)]
    profiles = [_profile(n, b, s, [0.5 + 4 * s] + [s, s]) for n, b, s in shapes]
    model = fit_overheads(profiles)
    assert model.coef_["warmup_first_s"] == pytest.approx((0.5, 3.0))
    assert model.coef_["outside_epoch_s"] == pytest.approx((0.1, 0.2))
    predicted = model.predict([[8, 64, 8], [1, 8, 1]], [1.0, 0.12])
    assert predicted["warmup_first_s"] == pytest.approx([3.5, 0.8])  # modelled, then the profile's own (not 0.86)
    assert predicted["outside_epoch_s"] == pytest.approx([0.125, 0.3])
    assert not model.notes_


def test_with_few_profiles_a_term_is_their_median_and_without_any_it_is_0_and_noted():
    few = RunOverheads().fit([[1, 8, 1], [1, 16, 1]], step_s=[0.1, 0.2], terms=[{"epoch_start_s": 0.3}, {}])
    assert few.coef_["epoch_start_s"] == (0.3, 0.0)
    assert few.predict([[2, 64, 2]], [5.0])["epoch_start_s"] == pytest.approx([0.3])
    none = fit_overheads([_profile(1, 8, 0.1, None)])
    assert all(np.all(values == 0) for values in none.predict([[2, 8, 2]], [0.1]).values())
    assert len(none.notes_) == 1 and all(term in none.notes_[0] for term in TERMS)


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
