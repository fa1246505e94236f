"""outcome_section.py: predicted against measured, restarts and relaunches, and training's loading and device memory
against what the profiles and the memory model said."""

from dataclasses import replace

from tests.unit.report_inputs import CHOSEN, INPUTS
from tula_hpc.core.records import Selection, TrainSummary
from tula_hpc.reporting.outcome_section import _loading, outcome_section

LINKS = {"accuracy": "predicted_vs_measured.png"}


def test_the_outcome_sets_the_run_against_its_prediction_with_its_restarts_and_relaunches():
    summary = TrainSummary.from_dict(INPUTS["summary"])
    selection = Selection.from_dict(INPUTS["selection"])
    text = outcome_section(LINKS, INPUTS["memory"], selection, summary, INPUTS["eval"])
    assert text.startswith("## Outcome\n| | predicted | measured |")
    assert "| 8.50 | 9.00 |" in text and "Relative time error +6.0%." in text
    assert "Test top-1 accuracy **90.00%**" in text and "as trained\n90.00%" in text
    assert "resumed from its checkpoint at step 13 (epoch 2, step 3)" in text
    assert "64 per device as 1 x 64: out of memory" in text and "64 per device as 2 x 32: completed" in text
    assert "Training's peak device memory 21.20 MB allocated (22.50 MB reserved) against 20.96 MB" in text
    assert text.endswith("![predicted vs measured](predicted_vs_measured.png)\n\n")
    plain = replace(summary, restarts_at_steps=[], attempts=None, peak_allocated_bytes=None)
    text = outcome_section(LINKS, INPUTS["memory"], selection, plain, INPUTS["eval"])
    assert "resumed" not in text and "relaunched" not in text and "peak device memory 22.50 MB (reserved)" in text


def test_the_outcome_says_whether_the_loaders_workers_keep_up_with_the_step():
    summary = TrainSummary.from_dict(INPUTS["summary"])
    chosen = {**CHOSEN, "model_step_s": 0.02, "loader_s": 0.03, "loader_bound": True}
    line = _loading(Selection.from_dict({**INPUTS["selection"], "chosen": chosen}), summary)
    assert line.endswith(
        "Its workers make a batch every 30.0 ms against a predicted 20.0 ms step: the loader sets the pace; more "
        "loader workers (data.num_workers, resources.cpus_per_task) or cheaper loading would save up to 10.0 ms a step."
    )
    chosen = {**chosen, "loader_s": 0.01, "loader_bound": False}
    assert _loading(Selection.from_dict({**INPUTS["selection"], "chosen": chosen}), summary).endswith("keeps up.")
    assert "workers" not in _loading(Selection.from_dict(INPUTS["selection"]), summary)  # no loader timed
