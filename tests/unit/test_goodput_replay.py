"""bench/goodput_replay.py on synthetic curves with a known answer: AdaScale's gain at a constant noise scale gives
each fixed batch's time to the target in closed form, the goodput choice follows the noise scale, a curve that never
reaches the target is a failure, and the result file opens with the summary; no measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tula_bench import goodput_replay as bench

RECIPE, SAMPLES, ROWS = 64, 6400, 10  # one row of progress: SAMPLES / RECIPE = 100 steps of the recipe
BATCHES = (64, 128, 256)


def write_traces(root: Path, steps: dict[int, float], variance, final: dict[int, float] | None = None) -> Path:
    """One model: N=1 x g=1 at per-device batches `steps` (b -> step time), a 2-node shape whose per-device batches
    are too large for the recipe, and a curve per batch: progress 100 k, metric k / ROWS (times final[B]), |G|^2 = 1
    and variance `variance(k)` at row k."""
    folder = root / "synthetic"
    folder.mkdir(parents=True)
    (folder / "trace.yaml").write_text(
        f"parameters: 1000\nbytes_per_parameter: 4\ntrain_samples: {SAMPLES}\nepochs: {ROWS}\nrecipe_batch: {RECIPE}\n"
    )
    rows = ["placement,local_bsz,step_time,sync_time"]
    rows += [f"1,{b},{t},0.0" for b, t in steps.items()]
    rows += [f"11,{b},{t},0.0" for b, t in steps.items() if b > RECIPE // 2]  # recipe / 2 ranks = 32: not traced
    (folder / "placements.csv").write_text("\n".join(rows) + "\n")
    for batch in BATCHES:
        top = (final or {}).get(batch, 1.0)
        lines = ["progress,iteration,metric,grad_sqr,grad_var"]
        lines += [f"{100.0 * k},{100 * k},{top * k / ROWS},1.0,{variance(k)}" for k in range(1, ROWS + 1)]
        (folder / f"validation-{batch}.csv").write_text("\n".join(lines) + "\n")
    return root


def gain(variance: float, scale: float) -> float:
    return (variance + 1) / (variance / scale + 1)


def test_constant_noise_every_fixed_batch_in_closed_form(tmp_path):
    """Steps free of their batch (a GPU below saturation) and B_noise = 3 B0: the target (0.99) lies at progress 990,
    each batch's time is 990 / gain x 0.1 s, the largest batch is the best fixed one and the goodput choice, statically
    and at every epoch."""
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0)
    (case,) = bench.replay_model(root / "synthetic")  # the 2-node shape cannot hold the recipe
    assert (case["nodes"], case["gpus_per_node"]) == (1, 1)
    assert case["target"] == pytest.approx(0.99)
    expected = {b: 990 / gain(3.0, b / RECIPE) * 0.1 for b in BATCHES}
    assert {r["batch"]: r["time_s"] for r in case["fixed"]} == pytest.approx(expected)
    assert case["recipe"]["time_s"] == pytest.approx(99.0)
    assert case["best_fixed"]["batch"] == case["static"]["batch"] == 256
    assert [c["batch"] for c in case["adaptive"]["changes"]] == [256]
    assert case["adaptive"]["time_s"] == pytest.approx(expected[256])
    assert case["adaptive_time_over_recipe"] == pytest.approx(expected[256] / 99.0)
    assert case["adaptive_time_over_best_fixed"] == pytest.approx(1.0)
    assert case["b_noise_start"] == pytest.approx(3.0 * RECIPE)


def test_adaptive_follows_the_noise_the_static_choice_misses(tmp_path):
    """No noise in the first row (a larger batch buys nothing: the recipe's cheap step wins), then B_noise = 1000 B0
    (the largest batch wins): the static choice stays at the recipe; the adaptive schedule learns the noise at the
    end of its second epoch (the first row closes at progress 100, the second at 200) and runs at 256 after it."""
    steps = {64: 0.1, 128: 0.15, 256: 0.25}
    root = write_traces(tmp_path, steps, lambda k: 0.0 if k == 1 else 1000.0)
    (case,) = bench.replay_model(root / "synthetic")
    assert case["static"]["batch"] == RECIPE
    assert case["static"]["time_s"] == pytest.approx(99.0)
    assert [(c["epoch"], c["progress"], c["batch"]) for c in case["adaptive"]["changes"]] == [
        (0, 0.0, 64),
        (2, pytest.approx(200.0), 256),
    ]
    expected = 200 * 0.1 + 790 / gain(1000.0, 4) * 0.25
    assert case["adaptive"]["time_s"] == pytest.approx(expected)
    assert case["adaptive_time_over_best_fixed"] <= 1.0


@pytest.mark.spawns
def test_a_curve_short_of_the_target_fails(tmp_path):
    """The largest batch's curve stops at 0.95 (below the 0.99 target): fixed at it fails, the best fixed batch is
    the next, and the adaptive schedule, which the noise sends there, fails too and is counted."""
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, final={256: 0.95})
    (case,) = bench.replay_model(root / "synthetic")
    fixed = {r["batch"]: r for r in case["fixed"]}
    assert not fixed[256]["reached"] and fixed[256]["time_s"] is None
    assert case["best_fixed"]["batch"] == 128
    assert not case["adaptive"]["reached"] and case["adaptive_time_over_best_fixed"] is None
    result = bench.run(root)
    assert result["summary"]["failures"] == 1
    assert result["summary"]["adaptive_time_over_recipe"] is None  # the median of one failure: infinitely slow
    assert not result["verdicts"]["failures"]["met"]


def test_curve_between_traced_batches_is_log_interpolated(tmp_path):
    curves = {64: [{"progress": 100.0, "metric": 0.2, "grad_sqr": 1.0, "grad_var": 2.0}]}
    curves[256] = [{"progress": 102.0, "metric": 0.6, "grad_sqr": 3.0, "grad_var": 4.0}]
    (row,) = bench.curve_at(curves, 128)
    assert row == pytest.approx({"progress": 101.0, "metric": 0.4, "grad_sqr": 2.0, "grad_var": 3.0})
    assert bench.curve_at(curves, 64) is curves[64]
    with pytest.raises(ValueError):
        bench.curve_at(curves, 512)


@pytest.mark.spawns
def test_result_file_opens_with_summary_and_leaves_fmnist_null(tmp_path):
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0)
    out = tmp_path / "goodput_replay.json"
    assert bench.main(["--traces", str(root), "--out", str(out), "--fmnist", str(tmp_path / "none.json")]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:2] == ["summary", "verdicts"]
    summary = result["summary"]
    assert summary["failures"] == 0
    assert summary["adaptive_time_over_best_fixed"] == pytest.approx(1.0)
    assert summary["static_time_over_best_fixed"] == pytest.approx(1.0)
    for key in bench.FMNIST:
        assert summary[key] is None
    assert result["fashion_mnist"]["source"] is None
    assert all(v["met"] for v in result["verdicts"].values())


@pytest.mark.spawns
def test_the_fashion_mnist_keys_are_the_training_benchs_figures(tmp_path):
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0)
    trained = tmp_path / "adaptive_fmnist.json"
    accuracy = {"mean": -0.1, "ci95": [-0.4, 0.2], "n": 5}
    figures = {"fmnist_adaptive_accuracy_minus_reference": accuracy, "fmnist_adaptive_steps_over_reference": 1.2}
    trained.write_text(json.dumps({"summary": {**figures, "other": 1}, "verdicts": {"a": {"met": True}}}))
    out = tmp_path / "goodput_replay.json"
    assert bench.main(["--traces", str(root), "--out", str(out), "--fmnist", str(trained)]) == 0
    result = json.loads(out.read_text())
    assert {key: result["summary"][key] for key in bench.FMNIST} == figures
    assert result["fashion_mnist"]["verdicts"] == {"a": {"met": True}}
