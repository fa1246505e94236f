"""The memory benchmarks' ground truth answers for the batch size it was asked about."""

from __future__ import annotations

import json

import pytest
from tula_bench import steady_truth
from tula_bench.common import bench_job


@pytest.mark.spawns
def test_the_answer_names_the_batch_size_not_the_last_data_batch():
    """Since e279873 the loop variable shadowed the size: the answer held a tensor pair and JSON refused it."""
    job = bench_job(as_name="bench-tiny", model={"name": "tiny_cnn"}, data={"image_size": 8})
    answer = steady_truth.measure(job, 4)
    assert answer["batch"] == 4 and answer["fits"]
    assert answer["steps"] == steady_truth.STEPS_PER_EPOCH * steady_truth.EPOCHS
    assert answer["peak_bytes"] > 0
    json.dumps(answer)


@pytest.mark.parametrize("argv", [[], ["--smoke"], ["--smoke", "--out", "x.json", "{}"]])
def test_the_command_takes_a_trial_or_a_smoke_run_with_its_own_result_file(argv, capsys):
    """A smoke run never writes bench/results/ (it needs --out); a trial is not also a smoke run."""
    with pytest.raises(SystemExit):
        steady_truth.main(argv)
    assert "error" in capsys.readouterr().err
