"""bench/adaptive_fmnist.py's smoke regime, its plan of cells and its tuning choice, with the DAG and training
replaced (no process started)."""

from __future__ import annotations

import pytest
from tula_bench import adaptive_fmnist as bench

from tula_hpc.core.atomic_files import read_jsonl


def _fake_cells(monkeypatch) -> list[dict]:
    """The DAG's choice and each cell's training replaced by records: accuracy and steps by kind, the same every
    seed; the cells asked for, in order."""
    started = []
    choice = {"phase": "choice", "batch": 64, "nodes": 2, "noise_scale": None, "measuring_wall_s": 1.0}
    choice["candidates_digest"] = "c0ffee"

    def run_cell(cell, chosen, scratch, scale):
        assert chosen is choice and scale == "smoke"
        started.append(cell)
        reference = cell["kind"] == "reference"
        return {
            **cell,
            "test_accuracy": 0.80 if reference else 0.81,
            "val_accuracy_precise_bn": 0.79,
            "steps": 20 if reference else 15,
            "train_time_s": 2.0,
        }

    monkeypatch.setattr(bench, "the_choice", lambda scratch, regime: choice)
    monkeypatch.setattr(bench, "run_cell", run_cell)
    return started


def test_smoke_runs_one_tuning_and_two_test_cells_with_its_cells_in_the_scratch(monkeypatch, tmp_path):
    started = _fake_cells(monkeypatch)
    monkeypatch.setattr(bench, "provenance", lambda: {"git_commit": "0" * 40})  # git is a process: fast tier
    regime = bench.Regime.smoke(tmp_path)
    assert regime.cells.parent == tmp_path and bench.RESULTS not in regime.cells.parents
    result = bench.run(tmp_path, regime)
    assert [(c["phase"], c["kind"], c["strategy"]) for c in started] == [
        ("tune", "adaptive", "adascale"),
        ("test", "reference", "lbt"),
        ("test", "adaptive", "adascale"),
    ]
    assert [r["key"] for r in read_jsonl(regime.cells)] == [c["key"] for c in started]
    assert result["settings"]["smoke"] and result["settings"]["strategies_tuned"] == ["adascale"]
    assert result["settings"]["regime"]["test_seeds"] == bench.SCALES["smoke"]["test_seeds"]
    assert result["summary"]["fmnist_adaptive_steps_over_reference"] == pytest.approx(0.75)
    assert result["verdicts"]["median_steps_below_the_reference"]["met"]
    started.clear()
    bench.run(tmp_path, regime)  # a second run finds every cell in its cells file
    assert started == []


def test_the_smoke_scale_changes_the_cells_keys_and_the_full_run_is_not_smoke():
    smoke = bench.cell("test", "adaptive", "adascale", 0, 64, {"candidates_digest": "c"}, "d", "smoke")
    full = bench.cell("test", "adaptive", "adascale", 0, 64, {"candidates_digest": "c"}, "d", bench.SCALE)
    assert smoke["key"] != full["key"]
    assert bench.adaptive_job("adascale", 0, "smoke").data.name == "digits"
    assert bench.Regime() == bench.Regime(bench.SCALE, bench.CELLS, bench.STRATEGIES)


def test_the_tuning_chooses_among_the_regime_s_strategies_by_validation_then_steps():
    tuning = [
        {"strategy": "adascale", "val_accuracy_precise_bn": 0.8, "steps": 30},
        {"strategy": "lrs", "val_accuracy_precise_bn": 0.8, "steps": 20},
    ]
    assert bench.tuned_strategy(tuning)["strategy"] == "lrs"
    assert bench.tuned_strategy(tuning[:1], ("adascale",))["strategy"] == "adascale"


def test_smoke_needs_out_so_bench_results_stays_untouched():
    with pytest.raises(SystemExit):
        bench.main(["--smoke"])
