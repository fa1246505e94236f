"""bench/memory_replay.py: recorded GPU cases replayed through the stage's fit, CUDA trials and choice."""

from __future__ import annotations

import copy
import json

import pytest
from tula_bench import memory_replay as replay

WHOLE_CARD = replay.CASES / "h200_first_run_resnet18_32_fp32_whole_card.json"


def _case() -> dict:
    return json.loads(WHOLE_CARD.read_text())


def test_the_card_answers_trials_from_the_truth_and_says_where_it_does_not_know():
    case = _case()  # Lightning saw 30512 fit and 30872 fail
    assert replay.answer(30512, case)["outcome"] == "fits" and replay.answer(30512, case)["known"]
    assert replay.answer(30872, case)["outcome"] == "out_of_memory" and replay.answer(30872, case)["known"]
    between = replay.answer(30700, case)
    assert between["outcome"] == "out_of_memory" and not between["known"]  # the cautious answer, counted


def test_the_replayed_choice_lies_at_or_below_the_largest_batch_seen_to_fit():
    row = replay.replay_case("whole_card", _case())
    assert row["chosen"] <= 30512 and row["rel_error"] >= -0.03 and not row["above_truth"]
    assert row["allocated_line"] > 30512  # the allocated line alone would have failed: the trials bring it down
    assert row["reserved_line_rel_error"] < -0.2  # the reserved line, which sized the batch before, was 27 % low


def test_a_truth_further_down_moves_the_choice_with_it():
    """The same probes on a card that holds 10 % less: the trials find the lower limit, never above it."""
    case = copy.deepcopy(_case())
    case["truth"].update(largest_fits=27461, smallest_fails=27700)
    row = replay.replay_case("lower", case)
    assert 27461 * 0.99 <= row["chosen"] <= 27461


@pytest.mark.spawns
def test_every_recorded_case_replays_and_none_lands_above_its_truth(tmp_path):
    assert replay.main(["--out", str(tmp_path / "replay.json")]) == 0
    summary = json.loads((tmp_path / "replay.json").read_text())["summary"]
    assert summary["cases"] >= 8 and summary["above_truth_cases"] == []
