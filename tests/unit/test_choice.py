"""The choice: the fastest, cheapest, goodput or knee candidate within the constraints, ties within the noise, the
rivals that could still win, or why none meets the constraints."""

import math

import pytest

from tests.unit.candidates import GRID, candidate, curve, objective
from tula_hpc.core.errors import StageError
from tula_hpc.performance.choice import (
    TIE_SIGMAS,
    InfeasibleError,
    best_time_per_batch,
    contenders,
    decide,
    kneedle_knee,
    model_knee,
    select,
)

RECIPE_BATCH = 128


def chosen(**changes):
    c = select(GRID, "node_hour", objective(**changes), RECIPE_BATCH)["chosen"]
    return c["nodes"], c["batch"]


def test_time_picks_the_fastest_and_cost_the_cheapest():
    assert chosen(minimize="time") == (4, 2048)
    assert chosen(minimize="cost") == (1, 2048)


@pytest.mark.parametrize(
    "constraint, expected",
    [
        ({"max_nodes": 2}, (2, 2048)),
        ({"max_batch": 256}, (4, 256)),
        ({"budget": 13.0}, (2, 2048)),  # 4 nodes cost at least 16.8, 2 nodes at B=1024 13.2
        ({"deadline_s": 6.0, "max_batch": 512, "minimize": "cost"}, (4, 512)),  # only 4 nodes finish in 6 s
    ],
)
def test_each_constraint_restricts_the_choice(constraint, expected):
    result = select(GRID, "node_hour", objective(**constraint), RECIPE_BATCH)
    assert (result["chosen"]["nodes"], result["chosen"]["batch"]) == expected
    for c in [result["chosen"], *result["runners_up"]]:
        assert c["nodes"] <= (constraint.get("max_nodes") or 99) and c["batch"] <= (
            constraint.get("max_batch") or 10**9
        )
        assert c["time_s"] <= (constraint.get("deadline_s") or 1e9) and c["cost"] <= (constraint.get("budget") or 1e9)


def test_kneedle_on_a_over_b_depends_only_on_the_sampled_range():
    batches = [2**k for k in range(5, 15)]
    assert kneedle_knee(curve(1000.0, 5.0, batches)) == kneedle_knee(curve(7.0, 0.1, batches)) == 1024
    assert kneedle_knee(curve(1000.0, 5.0, batches[:7])) == 256


def test_model_knee_is_where_doubling_stops_paying():
    # t = 1000/B + 10: doubling from 128 saves 3.9/17.8 = 22 %, from 256 saves 1.95/13.9 = 14 %, from 512 8 %.
    batches = [32, 64, 128, 256, 512, 1024]
    assert model_knee(curve(1000.0, 10.0, batches), min_saving=0.10) == 512
    assert model_knee(curve(1000.0, 10.0, batches), min_saving=0.20) == 256


def test_knee_objective_follows_the_chosen_knee_method_at_the_fastest_node_count():
    kneedle = select(GRID, "node_hour", objective(minimize="knee"), RECIPE_BATCH)
    model = select(GRID, "node_hour", objective(minimize="knee", knee_method="model"), RECIPE_BATCH)
    # Kneedle over B = 2^5..2^11 says 256 whatever a and c are; doubling stops saving 10 % from B = 512.
    assert kneedle["chosen"]["batch"] == kneedle["knees"]["kneedle"] == 256
    assert model["chosen"]["batch"] == model["knees"]["model"] == 512
    assert kneedle["chosen"]["nodes"] == model["chosen"]["nodes"] == 4
    assert (kneedle["knee_used"], model["knee_used"]) == ("kneedle", "model")
    assert len(kneedle["runners_up"]) == 5


def test_flat_curve_falls_back_to_the_model_knee():
    cands = [candidate(1, b, 10.0, 1.0) for b in (32, 64, 128, 256)]
    result = select(cands, "node_hour", objective(minimize="knee"), RECIPE_BATCH)
    assert result["knees"]["kneedle"] is None
    assert result["chosen"]["batch"] == result["knees"]["model"] == 32
    assert result["knee_used"] == "model"


def test_selection_names_both_knees_and_runners_up_with_time_and_cost():
    result = select(GRID, "node_hour", objective(minimize="cost"), RECIPE_BATCH)
    assert set(result["knees"]) == {"kneedle", "model"}
    assert all({"nodes", "batch", "time_s", "cost"} <= set(r) for r in result["runners_up"])
    costs = [result["chosen"]["cost"]] + [r["cost"] for r in result["runners_up"]]
    assert costs == sorted(costs)


def test_best_time_per_batch_keeps_the_fastest_node_count():
    cands = [candidate(1, 64, 10, 1), candidate(2, 64, 8, 1), candidate(2, 128, 5, 1)]
    assert [(c["nodes"], c["batch"]) for c in best_time_per_batch(cands)] == [(2, 64), (2, 128)]


def test_node_shapes_sharing_nodes_and_batch_are_told_apart():
    """2 nodes x 2 GPUs and 2 nodes x 1 GPU at B=256: different candidates, chosen and shown by their shape."""
    shapes = [
        {**candidate(2, 256, 4.0, 8.0), "gpus_per_node": 2, "per_device_batch": 64},
        {**candidate(2, 256, 6.0, 12.0), "gpus_per_node": 1},
        {**candidate(1, 256, 9.0, 9.0), "gpus_per_node": 2, "per_device_batch": 128},
    ]
    result = select(shapes, "node_hour", objective(), RECIPE_BATCH)
    assert (result["chosen"]["nodes"], result["chosen"]["gpus_per_node"]) == (2, 2)
    assert [(r["nodes"], r["gpus_per_node"]) for r in result["runners_up"]] == [(2, 1), (1, 2)]
    assert result["best_time_curve"] == [{"batch": 256, "nodes": 2, "gpus_per_node": 2, "time_s": 4.0}]
    with pytest.raises(InfeasibleError, match=r"N=2 x 2 GPU\(s\), B=256: time_s 4 s > deadline_s 1 s"):
        select(shapes, "node_hour", objective(deadline_s=1.0), RECIPE_BATCH)


def test_goodput_counts_the_steps_each_batch_needs_to_the_recipes_progress():
    """At B_noise = 256 the largest batches need many more epochs: time to the same progress is fastest at a
    middle batch, though time per recipe is fastest at the largest."""
    from tula_hpc.training.progress import steps_to_progress

    grid = []
    for c in GRID:
        factor = steps_to_progress(1.0, 256.0, 32, c["batch"]) * c["batch"] / 32  # epochs to progress / recipe's
        grid.append({**c, "progress_time_s": c["time_s"] * factor, "progress_cost": c["cost"] * factor})
    fastest = select(grid, "node_hour", objective(minimize="time"), RECIPE_BATCH)["chosen"]
    goodput = select(grid, "node_hour", objective(minimize="goodput"), RECIPE_BATCH)["chosen"]
    cheapest = select(grid, "node_hour", objective(minimize="goodput_cost"), RECIPE_BATCH)["chosen"]
    assert fastest["batch"] == 2048 and goodput["batch"] < 2048 and cheapest["nodes"] == 1
    assert goodput["progress_time_s"] == min(c["progress_time_s"] for c in grid)
    with pytest.raises(StageError, match="field 'objective.minimize': goodput needs the gradient noise scale"):
        select(GRID, "node_hour", objective(minimize="goodput"), RECIPE_BATCH)


def test_configurations_tied_within_the_noise_go_to_the_fewest_devices_then_the_recipes_batch():
    """Within half their combined band of the best's, the fewer nodes win, then the batch nearer the recipe's; with no
    noise the figure alone decides and nothing is said of a tie."""
    grid = [
        candidate(2, 1024, 100.0, 2.0, 0.03),
        candidate(1, 1024, 101.0, 1.0, 0.03),  # 1 / hypot(3, 3.03) = 0.23 sigma behind: tied
        candidate(2, 256, 100.5, 2.0, 0.03),
        candidate(1, 128, 150.0, 1.5, 0.03),  # 16 sigma behind
    ]
    time = objective(minimize="time")
    result = decide(grid, time, RECIPE_BATCH, tie_sigmas=0.5)
    assert (result["chosen"]["nodes"], result["chosen"]["batch"]) == (1, 1024)
    assert result["tie"]["best_by_figure"] == {"nodes": 2, "batch": 1024}
    assert result["tie"]["tied"] == [
        {"nodes": 2, "batch": 1024},
        {"nodes": 2, "batch": 256},
        {"nodes": 1, "batch": 1024},
    ]
    assert "fewest devices" in result["tie"]["rule"]
    two_nodes = decide(grid[::2], time, RECIPE_BATCH, tie_sigmas=0.5)["chosen"]
    assert (two_nodes["nodes"], two_nodes["batch"]) == (2, 256)  # same devices: the batch nearer 128
    exact = [{**c, "rel_uncertainty": 0.0} for c in grid]
    result = decide(exact, time, RECIPE_BATCH, tie_sigmas=0.5)
    assert (result["chosen"]["nodes"], result["chosen"]["batch"]) == (2, 1024) and result["tie"] is None


def test_by_default_only_equal_figures_tie_and_the_selection_says_so():
    """TIE_SIGMAS is 0 (chosen out of fold): 1 % apart within the noise is no tie; equal times are."""
    grid = [candidate(2, 1024, 100.0, 2.0, 0.03), candidate(1, 1024, 101.0, 1.0, 0.03)]
    assert TIE_SIGMAS == 0.0
    assert select(grid, "node_hour", objective(minimize="time"), RECIPE_BATCH)["chosen"]["nodes"] == 2
    equal = [grid[0], {**grid[1], "time_s": 100.0, "cost": 2.0}]  # equal in time and cost: the fewer nodes
    result = select(equal, "node_hour", objective(minimize="time"), RECIPE_BATCH)
    assert result["chosen"]["nodes"] == 1 and result["tie"]["best_by_figure"] == {"nodes": 2, "batch": 1024}


def test_ties_hold_for_every_objective_goodput_included():
    grid = [
        {**candidate(2, 1024, 100.0, 2.0, 0.05), "progress_time_s": 50.0, "progress_cost": 1.0},
        {**candidate(1, 512, 100.0, 1.0, 0.05), "progress_time_s": 51.0, "progress_cost": 0.51},
    ]
    for goal in ("time", "cost", "goodput", "goodput_cost"):
        chosen = decide(grid, objective(minimize=goal), RECIPE_BATCH, tie_sigmas=0.5)["chosen"]
        assert chosen["nodes"] == 1, goal


def test_contenders_are_the_unmeasured_best_then_the_rivals_within_the_band_likeliest_first():
    best = {**candidate(2, 1024, 100.0, 2.0, 0.05), "profiled": False}
    close = {**candidate(1, 1024, 104.0, 1.0, 0.05), "profiled": False}  # 4 / hypot(5, 5.2) = 0.55 sigma
    closer_measured = {**candidate(1, 512, 101.0, 1.0, 0.01), "profiled": True}
    far = {**candidate(1, 256, 115.0, 1.0, 0.05), "profiled": False}  # 15 / hypot(5, 5.75) = 1.97 sigma
    beyond = {**candidate(1, 128, 125.0, 1.0, 0.05), "profiled": False}  # 3.2 sigma
    pool = [best, closer_measured, close, far, beyond]
    shapes = [(c["nodes"], c["batch"]) for c in contenders(pool, "time")]
    assert shapes == [(2, 1024), (1, 1024)]  # one combined band (CONFIRM_BAND_SIGMAS)
    assert [(c["nodes"], c["batch"]) for c in contenders(pool, "time", band_sigmas=2.0)] == [
        (2, 1024),
        (1, 1024),
        (1, 256),
    ]
    assert contenders([{**best, "profiled": True}, closer_measured], "time") == []


def test_the_best_one_node_count_down_is_a_rival_whatever_its_band():
    """A model sure that 2 nodes beat 1 (a sync across nodes it takes for cheap) still has 1 node measured; the
    fewest nodes' step is up; a rival of another node count within the band stands in for it."""
    two = {**candidate(2, 256, 50.0, 2.0, 0.01), "profiled": True}
    one_small, one_large = ({**candidate(1, b, t, 1.0, 0.01), "profiled": False} for b, t in ((128, 90.0), (256, 80.0)))
    four = {**candidate(4, 512, 60.0, 4.0, 0.01), "profiled": False}
    pool = [two, four, one_large, one_small]  # the best first, by time
    assert [(c["nodes"], c["batch"]) for c in contenders(pool, "time")] == [(1, 256)]
    cheapest = [  # by cost: 1 node at the largest batch, far ahead within its band; 2 nodes unmeasured
        {**candidate(1, 256, 80.0, 1.0, 0.01), "profiled": False},
        {**candidate(1, 128, 90.0, 1.2, 0.01), "profiled": True},
        {**candidate(2, 256, 50.0, 2.0, 0.01), "profiled": False},
        four,
    ]
    assert [(c["nodes"], c["batch"]) for c in contenders(cheapest, "cost")] == [(1, 256), (2, 256)]
    near = {**candidate(4, 256, 50.2, 4.0, 0.01), "profiled": False}  # within one band, another node count
    assert [(c["nodes"], c["batch"]) for c in contenders([two, near, four, one_large], "time")] == [(4, 256)]
    assert contenders([two], "time") == []


@pytest.mark.parametrize("goal", ["time", "cost", "knee"])
def test_a_candidate_whose_figures_could_not_be_predicted_is_named_and_never_chosen(goal):
    # NaN compares false both ways: first at its batch, it held the time curve, met the deadline and sorted anywhere.
    nan = candidate(4, 2048, math.nan, math.nan)
    grid = [nan] + [c for c in GRID if (c["nodes"], c["batch"]) != (4, 2048)]
    result = select(grid, "node_hour", objective(minimize=goal, deadline_s=1e6), RECIPE_BATCH)
    expected = select(grid[1:], "node_hour", objective(minimize=goal, deadline_s=1e6), RECIPE_BATCH)
    assert result["unpredicted"] == [{"nodes": 4, "batch": 2048, "figures": ["time_s", "cost"]}]
    assert expected["unpredicted"] is None
    assert {k: v for k, v in result.items() if k not in ("unpredicted", "candidates")} == {
        k: v for k, v in expected.items() if k not in ("unpredicted", "candidates")
    }
    with pytest.raises(StageError, match=r"no candidate's figures could be predicted.*N=4, B=2048: time_s, cost"):
        decide([nan], objective(minimize=goal), RECIPE_BATCH)
