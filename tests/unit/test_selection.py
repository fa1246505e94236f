"""Stage select: the fastest, cheapest or knee candidate within the constraints, or why none meets them."""

import dataclasses
import json

import pytest

from tests.conftest import default_job
from tula_hpc.selection import (
    InfeasibleError,
    best_time_per_batch,
    kneedle_knee,
    model_knee,
    predicted_run,
    run_select,
    select,
    with_queue_waits,
)
from tula_hpc.stage import StageError


def candidate(nodes, batch, time_s, cost):
    return {
        "nodes": nodes,
        "batch": batch,
        "per_device_batch": batch // nodes,
        "time_s": time_s,
        "cost": cost,
        "rel_uncertainty": 0.05,
    }


def perfmodel(candidates):
    """perfmodel.json holding `candidates`."""
    fitted = {"params": {}, "identified": {}, "notes": [], "grad_bytes": 1.0, "train_samples": 1000, "epochs": 1}
    search = {"mode": "full", "history": [], "stopped": None}
    rest = {"profiled": [], "search": search, "leave_one_out": {}, "measurement_weight": 0.0, "noise_scale": None}
    return {
        "job": "digits-cnn",
        "collective": "ring",
        "pricing": "node_hour",
        **fitted,
        **rest,
        "candidates": candidates,
    }


def objective(**changes):
    """The default job's objective (kneedle, a 10 % model-knee saving, no constraints), minimising time."""
    return default_job(objective={"minimize": "time", **changes}).objective


def curve(a, c, batches, nodes=1):
    return [candidate(nodes, b, a / b + c, nodes * (a / b + c)) for b in batches]


# A hand-made model: more nodes are faster and dearer; time falls as a/B + c with a, c shrinking with N.
BATCHES = [2**k for k in range(5, 12)]
GRID = curve(1000.0, 10.0, BATCHES, nodes=1) + curve(600.0, 6.0, BATCHES, nodes=2) + curve(400.0, 4.0, BATCHES, nodes=4)


def chosen(**changes):
    c = select(GRID, "node_hour", objective(**changes))["chosen"]
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
    result = select(GRID, "node_hour", objective(**constraint))
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
    kneedle = select(GRID, "node_hour", objective(minimize="knee"))
    model = select(GRID, "node_hour", objective(minimize="knee", knee_method="model"))
    # Kneedle over B = 2^5..2^11 says 256 whatever a and c are; doubling stops saving 10 % from B = 512.
    assert kneedle["chosen"]["batch"] == kneedle["knees"]["kneedle"] == 256
    assert model["chosen"]["batch"] == model["knees"]["model"] == 512
    assert kneedle["chosen"]["nodes"] == model["chosen"]["nodes"] == 4
    assert (kneedle["knee_used"], model["knee_used"]) == ("kneedle", "model")
    assert len(kneedle["runners_up"]) == 5


def test_flat_curve_falls_back_to_the_model_knee():
    cands = [candidate(1, b, 10.0, 1.0) for b in (32, 64, 128, 256)]
    result = select(cands, "node_hour", objective(minimize="knee"))
    assert result["knees"]["kneedle"] is None
    assert result["chosen"]["batch"] == result["knees"]["model"] == 32
    assert result["knee_used"] == "model"


def test_selection_names_both_knees_and_runners_up_with_time_and_cost():
    result = select(GRID, "node_hour", objective(minimize="cost"))
    assert set(result["knees"]) == {"kneedle", "model"}
    assert all({"nodes", "batch", "time_s", "cost"} <= set(r) for r in result["runners_up"])
    costs = [result["chosen"]["cost"]] + [r["cost"] for r in result["runners_up"]]
    assert costs == sorted(costs)


def test_best_time_per_batch_keeps_the_fastest_node_count():
    cands = [candidate(1, 64, 10, 1), candidate(2, 64, 8, 1), candidate(2, 128, 5, 1)]
    assert [(c["nodes"], c["batch"]) for c in best_time_per_batch(cands)] == [(2, 64), (2, 128)]


def test_infeasible_constraints_name_the_closest_candidates_and_what_each_breaks(tmp_path):
    path = tmp_path / "perfmodel.json"
    path.write_text(json.dumps(perfmodel(GRID)))
    job = default_job(objective={"deadline_s": 3.0, "budget": 5.0})
    with pytest.raises(InfeasibleError) as err:
        run_select(job, path, tmp_path / "selection.json")
    message = str(err.value)
    assert message.startswith(
        "job 'digits-cnn': fields 'objective.deadline_s/objective.budget': no candidate meets the constraints"
    )
    # Closest first: the 4-node runs miss the deadline least; each names what it breaks and by how much.
    assert "N=4, B=2048: time_s 4.19531 s > deadline_s 3 s (+40%); cost 16.7812 > budget 5 (+236%)" in message
    assert message.count("N=") == 3
    assert not (tmp_path / "selection.json").exists()


def test_node_shapes_sharing_nodes_and_batch_are_told_apart():
    """2 nodes x 2 GPUs and 2 nodes x 1 GPU at B=256: different candidates, chosen and shown by their shape."""
    shapes = [
        {**candidate(2, 256, 4.0, 8.0), "gpus_per_node": 2, "per_device_batch": 64},
        {**candidate(2, 256, 6.0, 12.0), "gpus_per_node": 1},
        {**candidate(1, 256, 9.0, 9.0), "gpus_per_node": 2, "per_device_batch": 128},
    ]
    result = select(shapes, "node_hour", objective())
    assert (result["chosen"]["nodes"], result["chosen"]["gpus_per_node"]) == (2, 2)
    assert [(r["nodes"], r["gpus_per_node"]) for r in result["runners_up"]] == [(2, 1), (1, 2)]
    assert result["best_time_curve"] == [{"batch": 256, "nodes": 2, "gpus_per_node": 2, "time_s": 4.0}]
    with pytest.raises(InfeasibleError, match=r"N=2 x 2 GPU\(s\), B=256: time_s 4 s > deadline_s 1 s"):
        select(shapes, "node_hour", objective(deadline_s=1.0))


def test_goodput_counts_the_steps_each_batch_needs_to_the_recipes_progress():
    """At B_noise = 256 the largest batches need many more epochs: time to the same progress is fastest at a
    middle batch, though time per recipe is fastest at the largest."""
    from tula_hpc.noise_scale import steps_to_progress

    grid = []
    for c in GRID:
        factor = steps_to_progress(1.0, 256.0, 32, c["batch"]) * c["batch"] / 32  # epochs to progress / recipe's
        grid.append({**c, "progress_time_s": c["time_s"] * factor, "progress_cost": c["cost"] * factor})
    fastest = select(grid, "node_hour", objective(minimize="time"))["chosen"]
    goodput = select(grid, "node_hour", objective(minimize="goodput"))["chosen"]
    cheapest = select(grid, "node_hour", objective(minimize="goodput_cost"))["chosen"]
    assert fastest["batch"] == 2048 and goodput["batch"] < 2048 and cheapest["nodes"] == 1
    assert goodput["progress_time_s"] == min(c["progress_time_s"] for c in grid)
    with pytest.raises(StageError, match="field 'objective.minimize': goodput needs the gradient noise scale"):
        select(GRID, "node_hour", objective(minimize="goodput"))


def test_a_later_start_is_passed_over_exactly_when_its_wait_outweighs_its_saving():
    """objective.queue estimate: 4 nodes train in 40 s less than 2 nodes; waiting 39 s for them still pays, 41 s
    does not. The cost goal does not count the wait; ignoring the queue asks Slurm nothing."""
    grid = [candidate(2, 1024, 100.0, 2.0), candidate(4, 1024, 60.0, 3.0)]

    def pick(wait_for_four: float, goal: str = "time") -> int:
        waits = [{**grid[0], "wait_s": 0.0}, {**grid[1], "wait_s": wait_for_four}]
        return select(waits, "node_hour", objective(minimize=goal, queue="estimate"))["chosen"]["nodes"]

    assert pick(39.0) == 4 and pick(41.0) == 2 and pick(1e6, "cost") == 2 and pick(0.0, "cost") == 2
    job = default_job(objective={"minimize": "time", "queue": "estimate"})
    assert with_queue_waits(dataclasses.replace(job, launcher="local"), grid) == grid
    run = predicted_run(job, {**grid[1], "wait_s": 41.0})
    assert run["result_time_s"] == pytest.approx(101.0) and run["wait_s"] == 41.0
