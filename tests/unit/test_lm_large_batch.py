"""bench/lm_large_batch.py's pure parts on fake runs: steps and tokens to the target interpolated, the GPU step model
the adaptive arms choose with, the paired figures and targets over seeds (the runs themselves take minutes)."""

from __future__ import annotations

import pytest
from tula_bench import lm_large_batch as bench


def curve(losses: list[float], batch: int = 16, every: int = 10) -> list[dict]:
    return [
        {"step": every * (i + 1), "tokens": every * (i + 1) * batch * 64, "val_loss": loss, "global_batch": batch}
        for i, loss in enumerate(losses)
    ]


def test_steps_and_tokens_to_the_target_are_interpolated_between_the_validations_around_the_crossing():
    reached = bench.to_target(curve([3.0, 2.5, 2.0, 1.9]), 2.25)  # halfway between steps 20 and 30
    assert reached == pytest.approx({"steps": 25.0, "tokens": 25 * 16 * 64})


def test_a_target_reached_at_the_first_validation_or_never():
    assert bench.to_target(curve([2.0, 1.5]), 2.5) == {"steps": 10.0, "tokens": 10 * 16 * 64}
    assert bench.to_target(curve([3.0, 2.9]), 2.5) is None


def test_the_curve_is_every_validation_record_s_place_and_loss():
    history = [
        {"kind": "validation", "step": 5, "tokens": 40_960, "global_batch": 128, "epoch": 0, "val_loss": 3.0},
        {"kind": "batch_schedule", "step": 6, "tokens": 49_152, "global_batch": 128, "epoch": 0},
        {"epoch": 1, "step": 7, "tokens": 57_344, "global_batch": 128, "loss": 2.9, "val_loss": 2.8},
    ]
    assert bench.validation_curve({"history": history}) == [
        {"step": 5, "tokens": 40_960, "val_loss": 3.0, "global_batch": 128},
        {"step": 7, "tokens": 57_344, "val_loss": 2.8, "global_batch": 128},
    ]


def test_the_gpu_step_model_is_nearly_flat_up_to_8_b0_and_its_time_per_sequence_falls():
    rows = bench.gpu_candidates(50_000)
    assert [r["batch"] for r in rows] == [16, 32, 64, 128]
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps) and steps[-1] / steps[0] < 2.0 and steps[2] / steps[0] < 1.3
    assert bench.traced({32: 1.0, 64: 2.0}, 48) == pytest.approx(1.5)


def record(arm: str, seed: int, losses: list[float], batch: int = 16) -> dict:
    steps = 10 * len(losses)
    return {
        "arm": arm,
        "seed": seed,
        "batch": batch,
        "curve": curve(losses, batch),
        "steps": steps,
        "tokens": steps * batch * 64,
        "train_time_s": 100.0,
    }


@pytest.mark.spawns  # the result's provenance runs git
def test_paired_figures_and_targets_over_seeds():
    records = []
    for seed, shift in enumerate([0.0, 0.01, 0.02]):
        records += [
            record("recipe", seed, [3.0, 2.6, 2.2, 2.0 + shift]),  # target (2.0 + shift) x 1.01
            record("ramp", seed, [2.8, 2.0, 1.99, 1.99]),
            record("adaptive", seed, [2.5, 2.01, 2.0, 2.0]),
            record("large", seed, [3.1, 2.5, 2.3, 2.2], 128),
            record("ags", seed, [3.1, 2.5, 2.3, 2.1], 128),
        ]
    for r in records:
        r["final_val_loss"] = r["curve"][-1]["val_loss"]
    result = bench.figures(records, ["recipe", "large", "ags", "ramp", "adaptive"], "smoke", {"rows": [], "digest": ""})
    summary, targets = result["summary"], result["targets"]
    assert summary["ags_minus_large_batch_loss"]["mean"] == pytest.approx(-0.1)
    assert summary["adaptive_steps_over_recipe"]["n"] == 3 and summary["adaptive_steps_over_recipe"]["mean"] < 0.7
    assert summary["adaptive_steps_over_ramp"]["mean"] <= 1.0
    assert targets["adaptive_steps_at_most_0.7x_recipe"]["met"] and targets["adaptive_steps_at_most_ramp"]["met"]
    assert result["arms"]["large"]["seeds_reaching_target"] == 0
    assert result["arms"]["ramp"]["batch_over_run"][0] == [10 * 16 * 64, 16]
    assert list(summary) == list(bench.SUMMARY_KEYS)  # the four keys, the other comparisons beside them
    assert result["comparisons"]["adaptive_reset_minus_adaptive_loss"]["mean"] is None  # an arm not run: null
