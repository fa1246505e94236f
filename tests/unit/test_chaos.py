"""bench/chaos.py's bookkeeping on synthetic trials and files with known answers (the faults need the cluster)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
chaos = importlib.import_module("chaos")
sys.path.remove(str(BENCH))


def test_the_summary_counts_what_was_lost_and_compares_weights_only_where_a_trial_resumed_alike():
    trials = [
        {"completed": True, "resumed": True, "same_choice": True, "bit_equal": True, "unreadable_files": []},
        {"completed": True, "resumed": True, "same_choice": True, "bit_equal": False, "unreadable_files": ["a"]},
        {"completed": True, "resumed": True, "same_choice": False, "bit_equal": False, "unreadable_files": []},
        {"completed": True, "resumed": False, "same_choice": True, "bit_equal": True, "unreadable_files": []},
        {"completed": False},
    ]
    summary = chaos.summarise(trials, seed=7)
    assert summary == {
        "trials": 5,
        "completed": 4,
        "manual_steps": 1,
        "bad_files_accepted": 1,
        "steps_repeated_beyond_one": None,
        "bit_equal_share": 0.5,
        "seed": 7,
    }


def test_a_final_file_that_cannot_be_read_back_is_named(tmp_path):
    results = tmp_path / "results" / "job" / "train"
    results.mkdir(parents=True)
    (results / "summary.json").write_text(json.dumps({"epochs": 3}))
    (results.parent / "eval.json").write_text('{"test_accuracy": 0.9')  # cut short
    torch.save({"model": {}}, results / "model.pt")
    (results / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    assert sorted(chaos.unreadable(tmp_path, "job")) == [
        str(results.parent / "eval.json"),
        str(results / "checkpoint.pt"),
    ]


def test_each_fault_has_its_function_and_the_draws_replay_from_the_seed():
    assert sorted(chaos.FAULTS) == ["corrupt_checkpoint", "kill_driver", "kill_rank", "scancel_stage"]
    assert all(chaos.FAULTS[name].__name__ == name for name in chaos.FAULTS)
    assert chaos.draws(28, 40)[:5] == chaos.draws(28, 5)  # a trial is replayed alone by its index
    assert len({fault for fault, _ in chaos.draws(28, 40)}) == len(chaos.FAULTS)
    assert all(0 <= share < 1 for _, share in chaos.draws(28, 40))
