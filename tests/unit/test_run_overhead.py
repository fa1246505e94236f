"""run_overhead: the warm-up and epoch-end terms from profiles, on synthetic profiles with known answers."""

import numpy as np
import pytest

from tula_hpc.performance.run_overhead import (
    TERMS,
    RunOverheads,
    fit_overheads,
    profile_terms,
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
