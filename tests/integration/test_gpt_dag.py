"""The real DAG on a language model: a 2-layer GPT trained with AdamW on about 200 KB of Shakespeare's plays through
the local profile, every stage asking the causal_lm task (probe, profile, fit, select, train, evaluate, report)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import snakemake_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "gpt-small"
# A quick language model: the first 200,000 characters of the training works (validation and test keep their whole
# works), a 2-layer GPT 32 wide over windows of 32 characters, one pass over its training text.
GPT_JOB = {
    "task": {"name": "causal_lm"},
    "model": {"name": "gpt", "kwargs": {"layers": 2, "heads": 2, "width": 32}},
    "data": {"name": "shakespeare", "seq_len": 32, "kwargs": {"train_characters": 200_000}},
    "train": {
        "tokens": 200_000,
        "optimizer": "adamw",
        "strategy": "lrs",
        "lr": 0.004,
        "lr_base_batch": 32,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "lr_schedule": {"kind": "cosine", "warmup_steps": 10},
        "val_every_steps": 40,
        "val_samples": 128,
    },
    # The partial search's four corners, no confirming profiles, the probes in one process: a quick DAG.
    "search": {
        "nodes": {"min": 1, "max": 2},
        "batch": {"min": 32, "max": 64},
        "warmup_steps": 2,
        "steps": 4,
        "confirm": 0,
    },
    "resources": {"device_memory_gb": 1, "memory_probe_batches": [16, 32, 64], "memory_probes_in": "one_process"},
    "objective": {"minimize": "time"},
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpt-dag")
    configfile = workdir / "jobs.yaml"
    configfile.write_text(yaml.safe_dump({"targets": [JOB], "jobs": {JOB: GPT_JOB}}))
    proc = subprocess.run(snakemake_command(workdir, "local", configfile), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return workdir / "results" / JOB


def read(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def test_every_stage_runs_the_language_model_and_names_its_sequence_length(finished_run):
    results = finished_run
    memory = read(results, "memory.json")
    assert memory["seq_len"] == 32 and memory["max_batch_per_device"] > 64
    # AdamW holds two states per parameter; the probes count both.
    fixed = memory["composition"]["fixed_bytes"]
    assert fixed["optimizer_state"] >= 2 * fixed["parameters_and_buffers"]
    for candidate in read(results, "plan.json")["profile"]:
        profile = read(results, f"profile/N{candidate['nodes']}_B{candidate['batch']}.json")
        assert profile["seq_len"] == 32 and profile["tokens_per_s"] == pytest.approx(32 * profile["samples_per_s"])


def test_training_runs_to_its_token_budget_validating_on_the_way(finished_run):
    results = finished_run
    summary = read(results, "train/summary.json")
    chosen = read(results, "selection.json")["chosen"]
    assert summary["global_batch"] == chosen["batch"]
    assert summary["tokens"] >= 200_000 and summary["tokens"] - 200_000 < chosen["batch"] * 32
    mid_epoch = [record for record in summary["history"] if record.get("kind") == "validation"]
    assert mid_epoch and all(math.isfinite(record["val_loss"]) for record in mid_epoch)


def test_evaluation_scores_every_held_out_character_below_the_unigram_model(finished_run):
    evaluation = read(finished_run, "eval.json")
    assert evaluation["task"] == "causal_lm" and evaluation["headline"] == "loss"
    # Macbeth and Romeo and Juliet, 245,180 characters: (245,180 - 1) // 32 windows of 32 targets each.
    loss = evaluation["test_loss"]
    assert loss < 3.3  # the smoothed unigram model's cross-entropy on the test works is 3.31 nats per character
    assert evaluation["test_perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert evaluation["test_bits"] == pytest.approx(loss / math.log(2), rel=1e-6)
    report = (finished_run / "report.md").read_text()
    assert "bits per character" in report and "top-1" not in report
