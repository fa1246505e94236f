"""bench/trace_tuning.py: a setting's score is its regrets over their targets, and no setting that misses the search
cost's or the knee's target can win; equal scores go to the cheaper search."""

from __future__ import annotations

import pytest
from tula_bench import trace_tuning as tuning

FIGURES = {
    "time_regret_mean": 0.01,
    "time_regret_max": 0.05,
    "cost_regret_mean": 0.01,
    "cost_regret_max": 0.05,
    "profile_cost_share": 0.15,
    "knee_same_share": 0.95,
}


def test_a_setting_scores_its_regrets_over_their_targets():
    # targets: 2 % mean and 10 % worst regret, time and cost alike
    assert tuning.score(FIGURES) == pytest.approx(0.5 + 0.5 + 0.5 + 0.5)


def test_a_setting_that_misses_the_search_costs_or_the_knees_target_cannot_win():
    assert tuning.score({**FIGURES, "profile_cost_share": 0.31}) == float("inf")
    assert tuning.score({**FIGURES, "knee_same_share": 0.75}) == float("inf")
    settings = [
        {**FIGURES, "confirm": 2, "band_sigmas": 1.0, "tie_sigmas": 0.0, "knee_same_share": 0.75, "time_regret_max": 0},
        {**FIGURES, "confirm": 4, "band_sigmas": 1.0, "tie_sigmas": 0.0},
        {**FIGURES, "confirm": 3, "band_sigmas": 1.0, "tie_sigmas": 0.0},
    ]
    assert tuning.best_setting(settings)["confirm"] == 3  # equal scores: the cheaper search


def test_each_setting_of_the_grid_at_a_band_is_scored_once():
    """settings_figures walks the grid it is given (the smoke run's is 2x2 at a band), one row per (K, tie)."""
    meta = {"parameters": 1_000_000, "bytes_per_parameter": 4, "train_samples": 8192, "epochs": 2, "recipe_batch": 64}
    points = {(1, 1, b): (0.01 + 2e-4 * b, 0.0) for b in (16, 32, 64, 128)}
    trace = {"name": "synthetic", "meta": meta, "points": points, "gpus": [1]}
    grid = tuning.SMOKE_GRID
    table = tuning.settings_figures(trace, 1.0, grid, "latent", seeds=1, noise=0.0)
    assert [(row["confirm"], row["tie_sigmas"]) for row in table] == [
        (k, tie) for k in grid["confirm"] for tie in grid["tie_sigmas"]
    ]
    assert {row["band_sigmas"] for row in table} == {1.0}


def test_a_smoke_run_needs_its_own_result_file(capsys):
    """A smoke result never replaces bench/results/trace_tuning.json."""
    with pytest.raises(SystemExit):
        tuning.main(["--smoke"])
    assert "--out" in capsys.readouterr().err
