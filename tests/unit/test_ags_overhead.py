"""bench/ags_overhead.py: its verdict is judged on the measured epoch, and --smoke measures the cheap model alone."""

from __future__ import annotations

from tula_bench import ags_overhead


def test_the_verdict_is_the_measured_epoch_not_the_derived_one():
    model = {
        "measured_epoch": {"overhead": 0.05, "noise_floor": 0.01},
        "overhead_per_epoch": {"tensor": {"digits (1257 images)": 0.0}},
    }
    verdict = ags_overhead.judge({"target_overhead_per_epoch": 0.03, "models": {"tiny_cnn": model}})["tiny_cnn"]
    assert not verdict["met"] and verdict["measured_epoch_overhead"] == 0.05


def test_smoke_measures_the_tiny_cnn_alone_without_repeats():
    assert set(ags_overhead.SMOKE_MODELS) < set(ags_overhead.MODELS)
    assert all(repeats == 1 for _, repeats in ags_overhead.SMOKE_MODELS.values())
