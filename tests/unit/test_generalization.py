"""bench/generalization.py: --smoke plans the two cells of SMOKE in a fresh folder, and its jobs validate."""

from __future__ import annotations

import pytest
from tula_bench import generalization


def test_smoke_plans_the_reference_and_one_strategy_in_a_temporary_folder(tmp_path):
    with pytest.raises(SystemExit):
        generalization.options(["--smoke"])  # a smoke result never replaces bench/results/
    args = generalization.options(["--smoke", "--out", str(tmp_path / "generalization.json")])
    assert args.smoke and not args.ablation and args.scratch != generalization.WORK / "generalization"
    cells = generalization.plan_cells(args.runs, args.seeds, args.ablation, {}, args.batches, args.strategies)
    assert [(c["batch"], c["strategy"]) for c in cells] == [(generalization.SMALL_BATCH, "lbt"), (256, "ags")]
    assert all(generalization.cell_job(cell).train.epochs == 1 for cell in cells)


def test_without_smoke_the_options_are_the_full_tables():
    args = generalization.options([])
    assert not args.smoke and args.seeds == 3 and args.runs == list(generalization.DEFAULT_RUNS)
