"""A run's epochs: the epoch_time_s the model predicts for each (the terms run_overhead.py fits, on the steady epoch)
and the measured epochs against them. Plain arithmetic, apart from the fit, so that the evaluate stage (on the
login node) and the benches read it without scikit-learn."""

from __future__ import annotations

import math
import statistics

from tula_hpc.training.progress import whole_epochs


def epoch_times(row: dict, epochs: int) -> list[float]:
    """The predicted epoch_time_s of each of `epochs` epochs of a candidate row (fit_model's): the first with W_1 and
    no restart, the second with W_2, the rest steady (`epoch_s`)."""
    steady, start = row["epoch_s"], row.get("epoch_start_s", 0.0)
    times = [steady - start + row.get("warmup_first_s", 0.0), steady + row.get("warmup_second_s", 0.0)]
    return (times + [steady] * max(0, epochs - 2))[:epochs]


def run_time(row: dict, epochs: float) -> float:
    """The predicted time of a run of `epochs` (a fraction: its last epoch stopped part-way, by train.tokens or
    train.steps): `epoch_times` of its whole epochs, the last one's steps cut to the fraction run (its start and
    warm-up paid in full)."""
    whole = whole_epochs(epochs)
    steps_s = row["epoch_s"] - row.get("epoch_start_s", 0.0)
    return sum(epoch_times(row, whole)) - (whole - epochs) * steps_s


def restarts(epochs: float) -> int:
    """Epoch starts after the first in a run of `epochs` (a fraction: its last epoch partly run)."""
    return max(0, math.ceil(epochs) - 1)


def compare_epochs(measured: list[float], predicted: list[float]) -> dict:
    """metrics.jsonl's epoch_time_s against the prediction of the same epochs: the first epoch apart, and the later
    steady ones (from the third on, where W_2 has been paid; the second where there are no more) as medians."""
    later = slice(2, None) if len(measured) > 2 else slice(1, None)
    result = {
        "measured_first_epoch_s": measured[0] if measured else None,
        "predicted_first_epoch_s": predicted[0] if predicted else None,
        "measured_steady_epoch_s": statistics.median(measured[later]) if measured[later] else None,
        "predicted_steady_epoch_s": statistics.median(predicted[later]) if predicted[later] else None,
    }
    for part in ("first", "steady"):
        m, p = result[f"measured_{part}_epoch_s"], result[f"predicted_{part}_epoch_s"]
        result[f"{part}_epoch_rel_error"] = None if m is None or p is None or m <= 0 else (p - m) / m
    return result
