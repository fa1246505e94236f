"""bench/statistical_efficiency.py on synthetic AdaScale curves whose iterations follow the gain exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tula_bench import statistical_efficiency as bench

from tula_hpc.training.progress import adascale_gain  # noqa: E402


def write_curves(root: Path, base: int = 100, batches=(100, 400, 1600), rows: int = 5) -> Path:
    """One model: |G|^2 falling and the variance rising as training goes, the same at every batch; iterations at
    each batch exactly the progress over the gain."""
    folder = root / "synthetic"
    folder.mkdir(parents=True)
    for batch in batches:
        lines, done = ["progress,iteration,metric,grad_sqr,grad_var"], 0.0
        for k in range(1, rows + 1):
            sqr, var = 1.0 / k, 0.5 * k
            done += 50.0 / adascale_gain(sqr, var, batch / base)
            lines.append(f"{50.0 * k},{done},{0.1 * k},{sqr},{var}")
        (folder / f"validation-{batch}.csv").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.spawns
def test_curves_that_follow_the_gain_are_predicted_exactly(tmp_path):
    out = tmp_path / "result.json"
    assert bench.main(["--traces", str(write_curves(tmp_path / "traces")), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert next(iter(result)) == "summary"
    assert list(result["summary"]) == [
        "pollux_iterations_median_error",
        "goodput_accuracy_minus_reference",
        "goodput_time_over_reference",
        "adascale_worst_accuracy_minus_reference",
        "noise_scale_overhead",
    ]
    assert result["summary"]["pollux_iterations_median_error"] == pytest.approx(0.0, abs=1e-12)
    assert [c["batch"] for c in result["pollux"]["cases"]] == [400, 1600]  # the smallest batch is the base
    assert result["pollux"]["from_base_median_error"] == pytest.approx(0.0, abs=1e-12)  # same noise at every batch
    assert result["verdicts"]["pollux_iterations_median_error"]["met"]


def test_a_larger_batch_is_predicted_to_need_fewer_iterations_up_to_the_noise():
    rows = [{"progress": 100.0, "grad_sqr": 1.0, "grad_var": 1.0}]
    assert bench.predicted_iterations(rows, rows, 1.0) == [100.0]
    assert bench.predicted_iterations(rows, rows, 4.0) == [pytest.approx(100.0 / (2.0 / 1.25))]
