"""bench/memory_accuracy.py: its smoke run is the bench on its smallest case, written only where --out says."""

from __future__ import annotations

import pytest
from tula_bench import memory_accuracy as bench


def test_a_smoke_job_probes_in_its_own_process_and_the_bench_job_as_configured():
    assert bench.case_job("tiny_cnn", 8, smoke=True).resources.memory_probes_in == "one_process"
    assert bench.case_job("tiny_cnn", 8).resources.memory_probes_in == "auto"


def test_the_smoke_cases_are_among_the_benchs_own():
    """The smoke run measures a case the full run measures too, at one of its scales."""
    assert set(bench.SMOKE_CASES) <= set(bench.CASES)


def test_a_smoke_run_needs_its_own_result_file(capsys):
    """A smoke result never replaces bench/results/memory_accuracy.json."""
    with pytest.raises(SystemExit):
        bench.main(["--smoke"])
    assert "--out" in capsys.readouterr().err
