"""bench/memory_accuracy.py: its smoke run is the bench on its smallest cases, written only where --out says; the GPT
cases are the built-in GPT on token windows; targets are judged per family and overall."""

from __future__ import annotations

import pytest
from tula_bench import memory_accuracy as bench


def test_a_smoke_job_probes_in_its_own_process_and_the_bench_job_as_configured():
    assert bench.case_job(bench.Case("tiny_cnn", 8), smoke=True).resources.memory_probes_in == "one_process"
    assert bench.case_job(bench.Case("tiny_cnn", 8)).resources.memory_probes_in == "auto"


def test_the_smoke_cases_are_among_the_benchs_own_and_cover_both_families():
    """The smoke run measures cases the full run measures too, an image model and the GPT."""
    assert set(bench.SMOKE_CASES) <= set(bench.CASES)
    assert {case.family for case in bench.SMOKE_CASES} == {"images", "gpt"}


def test_the_gpt_cases_span_three_context_lengths_and_two_widths_each_past_its_probes():
    cases = bench.GPT_CASES
    assert {case.size for case in cases} == {64, 128, 256} and {case.width for case in cases} == {64, 128}
    for case, batches in cases.items():
        assert min(batches) > max(bench.gpt_probe_batches(case.size))
        assert {b * case.size for b in batches} == set(bench.GPT_TRUTH_TOKENS)  # the same tokens a batch at every T


def test_a_gpt_case_job_is_the_built_in_gpt_under_adamw_on_synthetic_tokens():
    job = bench.case_job(bench.Case("gpt", 128, 64))
    assert (job.model.name, job.model.kwargs["width"], job.model.kwargs["layers"]) == ("gpt", 64, 2)
    assert (job.data.name, job.data.seq_len, job.data.kwargs["vocab"]) == ("synthetic", 128, bench.GPT_VOCAB)
    assert (job.train.optimizer, job.train.strategy, job.task.name) == ("adamw", "lbt", "causal_lm")
    assert list(job.resources.memory_probe_batches) == [4, 8, 16]
    assert bench.Case("gpt", 128, 64).label(32) == "gpt width 64 T=128 b=32"
    assert bench.Case("tiny_cnn", 8).input == [1, 8, 8] and bench.Case("gpt", 128, 64).input == [128]


def _case(family: str, error: float, above: bool = False, label: str = "x") -> dict:
    return {"family": family, "rel_error": error, "largest_batch_above_truth": above, "label": label}


def test_targets_are_judged_on_the_largest_error_and_on_batches_above_the_truth():
    good = bench.judged([_case("gpt", 0.01), _case("gpt", -0.02), _case("gpt", 0.05, label="worst")])
    assert good["median_rel_error"] == pytest.approx(0.02) and good["max_rel_error"] == pytest.approx(0.05)
    assert good["worst_case"] == "worst" and good["under_predicted_cases"] == 1
    assert good["met"] == {"median": True, "max": True, "largest_batch_never_above_truth": True}
    bad = bench.judged([_case("gpt", -0.09, above=True), _case("gpt", 0.0)])
    assert bad["largest_batch_above_truth"] == 1
    assert bad["met"] == {"median": False, "max": False, "largest_batch_never_above_truth": False}


def test_a_smoke_run_needs_its_own_result_file(capsys):
    """A smoke result never replaces bench/results/memory_accuracy.json."""
    with pytest.raises(SystemExit):
        bench.main(["--smoke"])
    assert "--out" in capsys.readouterr().err
