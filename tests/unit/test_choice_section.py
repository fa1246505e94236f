"""choice_section.py: the choice and why, the time to the recipe's progress beside time per recipe, the cluster's
limits and queue, both knees and the runners-up."""

from dataclasses import replace

from tests.unit.report_inputs import CHOSEN, INPUTS
from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.reporting.choice_section import _cluster, _progress, choice_section

LINKS = {"time": "time_vs_batch.png", "cost": "cost_surface.png"}


def test_the_section_names_the_choice_its_objective_constraints_knees_and_runners_up():
    selection = Selection.from_dict({**INPUTS["selection"], "constraints": {"max_cost": 2.0}})
    text = choice_section(
        "toy",
        LINKS,
        INPUTS["plan"],
        FitResult.from_dict(INPUTS["perfmodel"]),
        selection,
        TrainSummary.from_dict(INPUTS["summary"]),
    )
    assert text.startswith("# tula-hpc report: toy\n\n## Choice\n**2 node(s), global batch 128** (64 per device)")
    assert "minimise **time** (node_hours pricing)" in text
    assert "Constraints: max_cost = 2 (6 of 6 candidates meet them)." in text
    assert "Kneedle 128" in text and "the\nknee objective used the model knee (asked for: `model`)" in text
    assert "| runner-up N | GPUs/node | B | T (s) | cost |" in text and "| 1 | - | 64 |" in text
    assert text.endswith("![time vs batch](time_vs_batch.png)\n\n![cost surface](cost_surface.png)\n\n")


def test_the_choice_sets_time_to_the_recipes_progress_beside_time_per_recipe():
    selection = Selection.from_dict(
        {
            **INPUTS["selection"],
            "chosen": {**CHOSEN, "progress_epochs": 3.5, "progress_time_s": 7.25, "progress_cost": 0.5},
            "predicted": {"time_s": 7.25, "cost": 0.5, "to": "progress"},
        }
    )
    noise_scale = {"b_noise": 96.0, "profiles": 3, "range": [80.0, 120.0]}
    perfmodel = FitResult.from_dict({**INPUTS["perfmodel"], "noise_scale": noise_scale})
    line = _progress(selection, perfmodel)
    assert "B_noise = 96, median of 3" in line and "in 3.5 epochs, 7.25 s, cost 0.5" in line
    assert line.endswith("Training runs to its progress.")
    assert "no multi-rank profile" in _progress(selection, replace(perfmodel, noise_scale=None))


def test_the_choice_names_the_partitions_limits_the_queue_wait_and_the_wall_time_asked_for():
    plan = {
        "partition": {
            "partition": "gpu",
            "excluded": [{"nodes": 8, "breaks": ["8 nodes > partition gpu's MaxNodes=4"]}],
        }
    }
    selection = Selection.from_dict(
        {**INPUTS["selection"], "predicted": {"time_s": 600.0, "wait_s": 300.0, "result_time_s": 900.0}}
    )
    summary = TrainSummary.from_dict({**INPUTS["summary"], "time_limit_min": 27})
    line = _cluster(plan, selection, summary)
    assert "Partition gpu left out 1 candidates: 8 nodes > partition gpu's MaxNodes=4." in line
    assert "a wait of 300 s before the 600.0 s of training, 900.0 s to the result" in line
    assert "Slurm's estimate at selection time" in line and "asked for a wall time of 27 min" in line
    no_wait, no_limit = replace(selection, predicted={"time_s": 1.0}), replace(summary, time_limit_min=None)
    assert _cluster({"partition": None}, no_wait, no_limit) == ""
