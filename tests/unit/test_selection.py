"""Stage select: the choice (choice.py) on perfmodel.json, the constraints' fields named when none meets them, the
queue's waits, and the run predicted for the choice."""

import dataclasses
import json

import pytest

from tests.conftest import default_job
from tests.unit.candidates import GRID, candidate, objective, perfmodel
from tula_hpc.performance.choice import InfeasibleError, select
from tula_hpc.stages.select import predicted_run, run_select, with_queue_waits


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


def test_a_later_start_is_passed_over_exactly_when_its_wait_outweighs_its_saving():
    """objective.queue estimate: 4 nodes train in 40 s less than 2 nodes; waiting 39 s for them still pays, 41 s
    does not. The cost goal does not count the wait; ignoring the queue asks Slurm nothing."""
    grid = [candidate(2, 1024, 100.0, 2.0), candidate(4, 1024, 60.0, 3.0)]

    def pick(wait_for_four: float, goal: str = "time") -> int:
        waits = [{**grid[0], "wait_s": 0.0}, {**grid[1], "wait_s": wait_for_four}]
        return select(waits, "node_hour", objective(minimize=goal, queue="estimate"), 1024)["chosen"]["nodes"]

    assert pick(39.0) == 4 and pick(41.0) == 2 and pick(1e6, "cost") == 2 and pick(0.0, "cost") == 2
    job = default_job(objective={"minimize": "time", "queue": "estimate"})
    assert with_queue_waits(dataclasses.replace(job, launcher="local"), grid) == grid
    run = predicted_run(job, {**grid[1], "wait_s": 41.0})
    assert run["result_time_s"] == pytest.approx(101.0) and run["wait_s"] == 41.0


def test_a_text_job_s_selection_names_its_seq_len_an_image_job_s_stays_as_it_was(tmp_path):
    path = tmp_path / "perfmodel.json"
    path.write_text(json.dumps(perfmodel(GRID)))
    run_select(default_job(), path, tmp_path / "image.json")
    run_select(default_job().updated(data={"seq_len": 64}), path, tmp_path / "text.json")
    assert "seq_len" not in json.loads((tmp_path / "image.json").read_text())
    assert json.loads((tmp_path / "text.json").read_text())["seq_len"] == 64
