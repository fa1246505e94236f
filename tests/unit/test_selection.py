import pytest

from tula_hpc.selection import best_time_per_batch, kneedle_knee, model_knee, select


def candidate(nodes, batch, time_s, cost):
    return {"nodes": nodes, "batch": batch, "per_device_batch": batch // nodes, "time_s": time_s, "cost": cost}


def perfmodel(candidates):
    return {"candidates": candidates}


def curve(a, c, batches):
    return [candidate(1, b, a / b + c, 1.0) for b in batches]


def test_time_picks_the_fastest_and_cost_the_cheapest():
    cands = [candidate(1, 64, 100, 1.0), candidate(2, 64, 60, 1.3), candidate(4, 128, 40, 2.0)]
    assert select(perfmodel(cands), "time")["chosen"]["nodes"] == 4
    assert select(perfmodel(cands), "cost")["chosen"]["nodes"] == 1


def test_kneedle_on_a_over_b_depends_only_on_the_sampled_range():
    batches = [2 ** k for k in range(5, 15)]
    assert kneedle_knee(curve(1000.0, 5.0, batches)) == kneedle_knee(curve(7.0, 0.1, batches)) == 1024
    assert kneedle_knee(curve(1000.0, 5.0, batches[:7])) == 256


def test_model_knee_is_where_doubling_stops_paying():
    # t = 1000/B + 10: doubling from 128 saves 3.9/17.8 = 22 %, from 256 saves 1.95/13.9 = 14 %, from 512 8 %.
    batches = [32, 64, 128, 256, 512, 1024]
    assert model_knee(curve(1000.0, 10.0, batches), min_saving=0.10) == 512
    assert model_knee(curve(1000.0, 10.0, batches), min_saving=0.20) == 256


def test_knee_objective_chooses_the_fastest_nodes_at_the_knee():
    batches = [2 ** k for k in range(5, 15)]
    cands = curve(1000.0, 5.0, batches) + [candidate(2, b, 1000.0 / b + 4.0, 2.0) for b in batches]
    result = select(perfmodel(cands), "knee")
    assert result["chosen"]["batch"] == result["knees"]["kneedle"] == 1024
    assert result["chosen"]["nodes"] == 2
    assert len(result["runners_up"]) == 5


def test_flat_curve_falls_back_to_the_model_knee():
    cands = [candidate(1, b, 10.0, 1.0) for b in (32, 64, 128, 256)]
    result = select(perfmodel(cands), "knee")
    assert result["knees"]["kneedle"] is None
    assert result["chosen"]["batch"] == result["knees"]["model"] == 32


def test_best_time_per_batch_keeps_the_fastest_node_count():
    cands = [candidate(1, 64, 10, 1), candidate(2, 64, 8, 1), candidate(2, 128, 5, 1)]
    assert [(c["nodes"], c["batch"]) for c in best_time_per_batch(cands)] == [(2, 64), (2, 128)]
