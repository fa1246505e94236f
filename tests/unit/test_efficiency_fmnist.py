"""bench/efficiency_fmnist.py's figures on synthetic cells with known differences."""

from __future__ import annotations

import json

import pytest
from tula_bench import efficiency_fmnist as bench


def _done(cells: list[dict], accuracy: dict[str, float]) -> dict[str, dict]:
    """A record per cell: accuracy by kind (+ 0.1 point per seed, shared by every kind, so the paired differences
    are exact), 1000 steps and 100 s for the reference, a tenth of the steps and twice the time at large batches."""
    done = {}
    for cell in cells:
        large = cell["kind"] == "adascale"
        done[cell["key"]] = {
            **cell,
            "phase": "test",
            "test_accuracy": accuracy[cell["kind"]] + 0.001 * cell["seed"],
            "epochs": 6,
            "steps": 100 if large else 1000,
            "train_time_s": 200.0 if large else 100.0,
        }
    return done


def test_paired_differences_ratios_and_verdicts():
    choices = {"bn_cnn": {"batch": 128}}
    cells = bench.plan(choices)
    seeds = bench.SCALES[bench.SCALE]["test_seeds"]
    assert len(cells) == len(seeds) * 5 and {c["kind"] for c in cells} == {"reference", "adascale", "goodput"}
    fig = bench.figures(cells, _done(cells, {"reference": 0.86, "adascale": 0.857, "goodput": 0.86}), choices)
    assert fig["complete"] and fig["cells_done"] == len(cells)
    assert fig["adascale_worst_accuracy_minus_reference"]["mean"] == pytest.approx(-0.3)
    assert fig["goodput_accuracy_minus_reference"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert fig["goodput_time_over_reference"] == pytest.approx(1.0)
    row = fig["tables"]["bn_cnn"]["adascale"]["4096"]
    assert row["steps_over_reference"] == pytest.approx(0.1) and row["time_over_reference"] == pytest.approx(2.0)
    verdicts = bench.met(fig)
    json.dumps(verdicts)  # plain bools: scipy's interval gives numpy floats, and their comparisons numpy bools
    assert verdicts["adascale_within_margin_every_cell"]["met"]
    assert verdicts["adascale_fewer_steps_every_cell"]["met"]
    assert verdicts["goodput_accuracy_within_margin"]["met"]
    assert not verdicts["goodput_less_wall_time"]["met"]


def test_a_cell_below_the_margin_fails_and_missing_cells_leave_figures_empty():
    cells = bench.plan({})
    fig = bench.figures(cells, _done(cells, {"reference": 0.86, "adascale": 0.85}), {})
    assert not bench.met(fig)["adascale_within_margin_every_cell"]["met"]
    assert fig["goodput_accuracy_minus_reference"] is None
    empty = bench.figures(cells, {}, {})
    assert not empty["complete"] and empty["adascale_worst_accuracy_minus_reference"] is None
    assert not any(v["met"] for v in bench.met(empty).values())


def test_the_smoke_goodput_job_measures_the_least_and_the_cpu_job_stays_as_it_was():
    cpu, smoke = bench.goodput_changes("bn_cnn"), bench.goodput_changes("bn_cnn", "smoke")
    assert cpu["search"] == {"nodes": {"min": 2, "max": 2}, "batch": {"min": 32, "max": 4096}}
    assert set(cpu["resources"]) == {"gpus_per_node", "cpus_per_task"}
    assert smoke["data"]["name"] == "digits" and smoke["search"]["batch"] == {"min": 32, "max": 64}
    bench.bench_config(as_name=bench.CHOICE_JOB, **smoke)  # the workflow accepts it
    assert bench.choice_digest("bn_cnn", "smoke") != bench.choice_digest("bn_cnn")
