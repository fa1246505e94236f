"""bench/max_batch_search.py: Lightning's search ends at a boundary it measured on both sides; the smoke run is the
bench on its smallest case, written only where --out says."""

from __future__ import annotations

import pytest
from tula_bench import max_batch_search as bench


class Card:
    """Trials answered by a rule instead of a process: fits up to `largest`."""

    def __init__(self, largest: int):
        self.largest, self.answers = largest, {}

    def fits(self, batch: int) -> bool:
        self.answers[batch] = batch <= self.largest
        return self.answers[batch]


@pytest.mark.parametrize("largest", [2, 3, 5, 100])
def test_lightnings_search_ends_at_the_true_largest_batch(largest):
    trials = Card(largest)
    found = bench.lightning_binsearch(trials)
    assert bench.true_largest(trials, found) == largest


def test_the_smoke_budget_leaves_lightning_three_trials():
    """A truth of 2 or 3 (what SMOKE_BUDGET_GB leaves) takes the fewest trials the search can end in."""
    trials = Card(3)
    bench.lightning_binsearch(trials)
    assert sorted(trials.answers) == [2, 3, 4]


def test_a_smoke_job_takes_its_budget_and_changes_and_the_bench_job_its_own():
    smoke, full = bench.budget_job("tiny_cnn", 8, smoke=True), bench.budget_job("tiny_cnn", 8)
    assert smoke.resources.device_memory_gb == bench.SMOKE_BUDGET_GB["tiny_cnn", 8]
    assert list(smoke.resources.memory_probe_batches) == bench.SMOKE_JOB["resources"]["memory_probe_batches"]
    assert smoke.train.ags.small_batch == 2 and smoke.resources.memory_probes_in == "one_process"
    assert full.resources.device_memory_gb == bench.BUDGET_GB["tiny_cnn", 8]
    assert full.resources.memory_probes_in == "auto"


def test_a_smoke_run_needs_its_own_result_file(capsys):
    """A smoke result never replaces bench/results/max_batch_search.json."""
    with pytest.raises(SystemExit):
        bench.main(["--smoke"])
    assert "--out" in capsys.readouterr().err
