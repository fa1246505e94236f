"""bench/trace_figures.py: several seeds' figures in one (each number averaged, each worst case the worst of all
with its seed, lists joined, a figure one seed lacks none), and the verdicts against the targets."""

from __future__ import annotations

import pytest
from tula_bench import trace_figures as figures


def test_seeds_average_their_numbers_and_keep_the_worst_case_with_its_seed():
    seeds = [
        {"time_regret_mean": 0.01, "max_error": {"error": 0.2, "nodes": 2}, "added": [1], "loo": None},
        {"time_regret_mean": 0.03, "max_error": {"error": 0.5, "nodes": 4}, "added": [2, 3], "loo": 0.1},
    ]
    merged = figures.over_seeds(seeds)
    assert merged["time_regret_mean"] == pytest.approx(0.02)
    assert merged["max_error"] == {"error": 0.5, "nodes": 4, "seed": 1}
    assert merged["added"] == [1, 2, 3] and merged["loo"] is None


def test_verdicts_follow_each_targets_kind():
    summary = dict.fromkeys(figures.TARGETS, 0.0) | {"knee_same_share": 0.95, "sigma1_coverage": 0.8}
    found = figures.verdicts(summary | {"profile_cost_share": 0.31}, rough=0.034)
    assert found["time_regret_max"]["met"] and found["knee_same_share"]["met"]
    assert not found["sigma1_coverage"]["met"] and not found["profile_cost_share"]["met"]
    assert found["partial_median_error"]["target_below_roughness"] is False
