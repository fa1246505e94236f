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


def rising(batch: int, k: int) -> float:
    return k / ROWS


def write_traces(root: Path, steps: dict[int, float], variance, metric=rising, better: str | None = None) -> Path:
    """One model: N=1 x g=1 at per-device batches `steps` (b -> step time), a 2-node shape whose per-device batches
    are too large for the recipe, and a curve per batch: progress 100 k, metric `metric(batch, k)`, |G|^2 = 1 and
    variance `variance(k)` at row k; trace.yaml's metric_better `better` (none where None)."""
    folder = root / "synthetic"
    folder.mkdir(parents=True)
    meta = (
        f"parameters: 1000\nbytes_per_parameter: 4\ntrain_samples: {SAMPLES}\nepochs: {ROWS}\nrecipe_batch: {RECIPE}\n"
    )
    (folder / "trace.yaml").write_text(meta + ("" if better is None else f"metric_better: {better}\n"))
    rows = ["placement,local_bsz,step_time,sync_time"]
    rows += [f"1,{b},{t},0.0" for b, t in steps.items()]
    rows += [f"11,{b},{t},0.0" for b, t in steps.items() if b > RECIPE // 2]  # recipe / 2 ranks = 32: not traced
    (folder / "placements.csv").write_text("\n".join(rows) + "\n")
    for batch in BATCHES:
        lines = ["progress,iteration,metric,grad_sqr,grad_var"]
        lines += [f"{100.0 * k},{100 * k},{metric(batch, k)},1.0,{variance(k)}" for k in range(1, ROWS + 1)]
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

    def short(batch: int, k: int) -> float:
        return (0.95 if batch == 256 else 1.0) * k / ROWS

    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, short)
    (case,) = bench.replay_model(root / "synthetic")
    fixed = {r["batch"]: r for r in case["fixed"]}
    assert not fixed[256]["reached"] and fixed[256]["time_s"] is None
    assert case["best_fixed"]["batch"] == 128
    assert not case["adaptive"]["reached"] and case["adaptive_time_over_best_fixed"] is None
    result = bench.run(root)
    assert result["summary"]["failures"] == 1
    assert result["summary"]["adaptive_time_over_recipe"] is None  # the median of one failure: infinitely slow
    assert not result["verdicts"]["failures"]["met"]


def test_falling_loss_reaches_its_relative_target_in_closed_form(tmp_path):
    """A loss 1 + 1/k at row k (progress 100 k) at every batch, lower better, B_noise = 3 B0, steps free of their
    batch: the recipe ends at 1.1, the target 1.1 x 1.01 = 1.111 lies between rows 9 (1.1111...) and 10 (1.1) at
    progress 901, the old one (1.1 + 0.01) at 910; never at the first row (a loss of 2) as a sign error would have
    it. Each batch takes 901 / gain steps of 0.1 s."""
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, lambda batch, k: 1 + 1 / k, "lower")
    (case,) = bench.replay_model(root / "synthetic")
    assert case["metric_better"] == "lower"
    assert case["target"] == pytest.approx(1.111)
    assert case["recipe"]["progress"] == pytest.approx(901.0)
    assert case["recipe"]["steps"] == pytest.approx(901.0)
    expected = {b: 901 / gain(3.0, b / RECIPE) * 0.1 for b in BATCHES}
    assert {r["batch"]: r["time_s"] for r in case["fixed"]} == pytest.approx(expected)
    assert case["adaptive"]["time_s"] == pytest.approx(expected[256])
    assert case["adaptive_time_over_recipe"] == pytest.approx(expected[256] / 90.1)
    old = case["old_target"]
    assert old["target"] == pytest.approx(1.11)
    assert old["recipe"]["time_s"] == pytest.approx(91.0)
    assert old["adaptive_time_over_recipe"] == pytest.approx(910 / gain(3.0, 4) * 0.1 / 91.0)


def test_falling_loss_that_levels_off_above_the_target_fails(tmp_path):
    """The largest batch's loss levels off 0.1 higher (its best, 1.2, is above the 1.111 target): fixed at it
    fails, the best fixed batch is the next, and the adaptive schedule, sent there by the noise, fails too."""

    def loss(batch: int, k: int) -> float:
        return (1.1 if batch == 256 else 1.0) + 1 / k

    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, loss, "lower")
    (case,) = bench.replay_model(root / "synthetic")
    fixed = {r["batch"]: r for r in case["fixed"]}
    assert not fixed[256]["reached"] and fixed[128]["reached"]
    assert case["best_fixed"]["batch"] == 128
    assert not case["adaptive"]["reached"] and case["adaptive_time_over_best_fixed"] is None


@pytest.mark.parametrize(("better", "level"), [(None, 0.5), ("higher", 0.5), ("lower", 0.5), ("lower", 0.0)])
def test_a_flat_curve_reaches_its_target_at_its_first_row(tmp_path, better, level):
    """A curve already at its target at its first row (flat; a word error rate of 0 too) reaches it there: the
    steps to that row (100 / gain) are counted, under both targets, and every ratio is a number."""
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, lambda batch, k: level, better)
    (case,) = bench.replay_model(root / "synthetic")
    for section in (case, case["old_target"]):
        assert section["recipe"]["progress"] == pytest.approx(100.0)
        assert section["recipe"]["time_s"] == pytest.approx(10.0)
        assert {r["batch"]: r["steps"] for r in section["fixed"]} == pytest.approx(
            {b: 100 / gain(3.0, b / RECIPE) for b in BATCHES}
        )
        assert section["adaptive_time_over_recipe"] == pytest.approx(1 / gain(3.0, 4))


@pytest.mark.parametrize("value", ["worse", "Lower", "[lower]", "1"])
def test_metric_better_other_than_higher_or_lower_names_the_file_and_field(tmp_path, value):
    root = write_traces(tmp_path, dict.fromkeys(BATCHES, 0.1), lambda k: 3.0, better=value)
    with pytest.raises(SystemExit, match=r"synthetic/trace\.yaml: metric_better must be one of \['higher', 'lower'\]"):
        bench.replay_model(root / "synthetic")


def test_metric_better_defaults_to_higher(tmp_path):
    assert bench.metric_sign(tmp_path, {}) == bench.metric_sign(tmp_path, {"metric_better": "higher"}) == 1
    assert bench.metric_sign(tmp_path, {"metric_better": "lower"}) == -1


def test_targets_lie_on_the_worse_side_of_the_final_metric():
    assert bench.targets(0.9, 1) == pytest.approx({"target": 0.891, "old_target": 0.89})
    assert bench.targets(2.0, -1) == pytest.approx({"target": 2.02, "old_target": 2.01})
    assert bench.targets(-2.0, 1) == pytest.approx({"target": -2.02, "old_target": -2.01})  # a log-likelihood
    assert bench.targets(0.0, -1) == {"target": 0.0, "old_target": 0.01}


def test_first_reach_interpolates_after_a_dip_and_never_before_the_first_row():
    """Metric 0.5, 0.2, 0.9 at progress 100, 200, 300 (higher better): 0.8 is first reached at 200 + 0.6 / 0.7 x
    100 (the dip's 0.2 to 0.9), 0.4 at the first row (100), not at 0; nothing before the first row."""
    rows = [
        {"progress": 100.0 * k, "metric": m, "grad_sqr": 1.0, "grad_var": 0.0}
        for k, m in ((1, 0.5), (2, 0.2), (3, 0.9))
    ]
    course = bench.Course(64, 64, rows)
    assert course.first_reach(150.0, 300.0, 0.8) == pytest.approx(200 + 0.6 / 0.7 * 100)
    assert course.first_reach(150.0, 250.0, 0.8) is None
    assert course.first_reach(0.0, 300.0, 0.4) == pytest.approx(100.0)
    assert course.first_reach(0.0, 50.0, 0.4) is None
    lower = bench.Course(64, 64, rows, sign=-1)
    assert lower.first_reach(0.0, 300.0, 0.3) == pytest.approx(100 + 2 / 3 * 100)  # 0.5 down to 0.2 crosses 0.3
    with pytest.raises(ValueError, match="progress must rise"):
        bench.Course(64, 64, [rows[1], rows[0]])


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
