"""bench/shakespeare_gpt.py's pure parts on fake runs: a Snakemake log read into each stage's wall time, a seed's
eval.json against the trigram, the verdict and spread over seeds (the runs themselves take minutes: never here)."""

from __future__ import annotations

import json

import pytest
import yaml
from tula_bench import shakespeare_gpt as bench

LOG = """\
Building DAG of jobs...
[Sat Nov 28 10:00:00 2026]
localrule probe_memory:
    input: config
    output: results/gpt/memory.json
    jobid: 4
    wildcards: job=gpt

[Sat Nov 28 10:00:30 2026]
Finished jobid: 4 (Rule: probe_memory)
1 of 5 steps (20%) done
[Sat Nov 28 10:00:30 2026]
rule profile:
    jobid: 2
    wildcards: job=gpt, config=a
[Sat Nov 28 10:00:31 2026]
rule profile:
    jobid: 3
    wildcards: job=gpt, config=b

[Sat Nov 28 10:00:50 2026]
Finished jobid: 2 (Rule: profile)
[Sat Nov 28 10:01:30 2026]
Finished jobid: 3 (Rule: profile)
[Sat Nov 28 10:01:30 2026]
rule train:
    jobid: 1
"""


def test_each_stage_runs_from_its_first_start_to_its_last_finish_and_an_unfinished_job_is_left_out():
    walls = bench.stage_walls(LOG)
    assert walls["probe_memory"] == {"jobs": 1, "job_seconds": 30.0, "wall_s": 30.0}
    assert walls["profile"] == {"jobs": 2, "job_seconds": 20.0 + 59.0, "wall_s": 60.0}
    assert "train" not in walls  # started, never finished: the run stopped there


def test_a_single_digit_day_is_read_as_time_asctime_pads_it():
    log = "[Sun Nov  1 09:00:00 2026]\nrule fit:\n    jobid: 7\n"
    log += "[Sun Nov  1 09:00:05 2026]\nFinished jobid: 7 (Rule: fit)\n"
    assert bench.stage_walls(log)["fit"]["wall_s"] == 5.0


def fake_run(tmp_path, loss: float):
    (tmp_path / "results" / "gpt").mkdir(parents=True)
    (tmp_path / "results" / "gpt" / "eval.json").write_text(json.dumps({"test_loss": loss, "test_bits": loss / 0.693}))
    (tmp_path / ".snakemake" / "log").mkdir(parents=True)
    (tmp_path / ".snakemake" / "log" / "2026-11-28T095900.000000.snakemake.log").write_text("an earlier run\n")
    (tmp_path / ".snakemake" / "log" / "2026-11-28T100000.000000.snakemake.log").write_text(LOG)
    return tmp_path


def test_a_seed_reads_its_test_loss_against_the_trigram_and_its_stages_from_the_newest_log(tmp_path):
    result = bench.seed_result(fake_run(tmp_path, 1.9), "gpt", 3, trigram_nats=2.05)
    assert (result["seed"], result["test_loss"], result["trigram_met"]) == (3, 1.9, True)
    assert set(result["stages"]) == {"probe_memory", "profile"}
    assert not bench.seed_result(tmp_path, "gpt", 3, trigram_nats=1.8)["trigram_met"]


def test_a_run_without_a_snakemake_log_is_an_error_naming_the_folder(tmp_path):
    fake_run(tmp_path, 1.9)
    for log in (tmp_path / ".snakemake" / "log").iterdir():
        log.unlink()
    with pytest.raises(FileNotFoundError, match="no Snakemake log"):
        bench.seed_result(tmp_path, "gpt", 0, trigram_nats=2.05)


def seed(loss: float, trigram: float = 2.05) -> dict:
    return {"test_loss": loss, "trigram_met": loss <= trigram}


def test_the_target_holds_only_when_every_seed_is_at_or_below_the_trigram():
    baselines = {"trigram_nats": 2.05, "unigram_nats": 3.32}
    met = bench.over_seeds([seed(1.9), seed(2.0), seed(2.05)], baselines)
    assert met["target"]["met"] and met["target"]["figure"] == 2.05 and met["seeds_meeting_target"] == 3
    assert met["test_loss_mean"] == pytest.approx(1.983333, abs=1e-5)
    assert met["test_loss_std"] == pytest.approx(0.076376, abs=1e-5)
    low, high = met["test_loss_ci95"]
    assert low < met["test_loss_mean"] < high and high - low == pytest.approx(2 * 4.302653 * 0.076376 / 3**0.5, 1e-4)
    missed = bench.over_seeds([seed(1.9), seed(2.1)], baselines)
    assert not missed["target"]["met"] and missed["seeds_meeting_target"] == 1


def test_the_seed_overlay_sets_train_seed_of_the_examples_one_job(tmp_path):
    example = tmp_path / "example.yaml"
    example.write_text(yaml.safe_dump({"jobs": {"shakespeare-gpt": {"model": {"name": "gpt"}}}}))
    assert bench.example_job(example) == "shakespeare-gpt"
    assert bench.seed_overlay("shakespeare-gpt", 2) == {"jobs": {"shakespeare-gpt": {"train": {"seed": 2}}}}
    example.write_text(yaml.safe_dump({"jobs": {"a": {}, "b": {}}}))
    with pytest.raises(SystemExit, match="one job"):
        bench.example_job(example)
