"""bench/perf_accuracy.py: pooled figures keep the largest error as the largest, the second-batch rule is chosen on
the other models, targets are judged as ratios to the noise floor, and measurements made by other code are not
re-analysed; synthetic records with known answers, no measurement."""

from __future__ import annotations

import statistics
import sys

import pytest
from tula_bench import perf_accuracy as bench


def raw_model(name: str, errors: dict[str, float], count: int = 4, noise: float = 0.1, share: float = 0.2) -> dict:
    """A model's raw figures: every error of a search equal (errors, default 0.05), `count` per round, 3 rounds."""
    rounds = range(3)
    return {
        "configs": count,
        "rounds": len(rounds),
        "errors": {
            search: [
                {"model": name, "round": r, "nodes": 1, "batch": 8 << c, "error": errors.get(search, 0.05)}
                for r in rounds
                for c in range(count)
            ]
            for search in bench.SEARCHES
        },
        "campaigns": {
            search: [
                {
                    "model": name,
                    "round": r,
                    "profiled": 4,
                    "cost_s": 10 * share,
                    "cost_share": 1.0 if search == "full" else share,
                    **{f"{goal}_regret": 0.0 for goal in bench.OBJECTIVES},
                }
                for r in rounds
            ]
            for search in bench.SEARCHES
        },
        "noise": [
            {"model": name, "round": r, "nodes": 1, "batch": 8 << c, "error": noise, "disturbed": False}
            for r in rounds
            for c in range(count)
        ],
    }


def test_the_largest_error_is_the_largest_of_all_and_medians_pool_every_error():
    raw = {
        "a": raw_model("a", {"full": 0.01}, count=10),
        "b": raw_model("b", {"full": 0.5}, count=1),
        "c": raw_model("c", {"full": 0.6}, count=1),
    }
    raw["b"]["errors"]["full"][2] = {"model": "b", "round": 2, "nodes": 2, "batch": 64, "error": 0.9}
    raw["c"]["campaigns"]["partial/largest"][1]["knee_regret"] = 0.2
    analysis = bench.analyse(raw)
    full = analysis["overall"]["full"]
    # The median of per-model maxima would say 0.6, the median of per-model medians 0.5.
    assert full["max_rel_error"] == {"value": 0.9, "model": "b", "round": 2, "nodes": 2, "batch": 64}
    assert full["median_rel_error"] == pytest.approx(0.01)
    assert analysis["models"]["b"]["modes"]["full"]["max_rel_error"]["value"] == 0.9
    knee = analysis["overall"]["partial"]["knee_regret_max"]
    assert knee == {"value": 0.2, "model": "c", "round": 1}
    assert analysis["noise_floor"] == pytest.approx(0.1)


def test_each_model_is_scored_under_the_rule_that_wins_on_the_other_models():
    # a favours middle, b and c largest. a is scored under largest (b and c's choice); b under middle, as on a and
    # c together a's large error with largest outweighs c's: c likewise. a's own preference never decides for a.
    raw = {
        "a": raw_model("a", {"partial/largest": 0.5, "partial/middle": 0.1, "adaptive/middle": 0.07}),
        "b": raw_model("b", {"partial/largest": 0.1, "partial/middle": 0.3}),
        "c": raw_model("c", {"partial/largest": 0.1, "partial/middle": 0.3}),
    }
    analysis = bench.analyse(raw)
    choice = analysis["second_batch"]
    # For b: largest on {a, c} pools 0.5 and 0.1 (median 0.3), middle 0.1 and 0.3 (median 0.2).
    assert choice["per_model"] == {"a": "largest", "b": "middle", "c": "middle"}
    assert choice["default"] == "largest"  # 0.1 (b, c) against 0.3 (b, c) on all three
    assert analysis["models"]["a"]["second_batch"]["held_out_median_rel_error"] == pytest.approx(0.5)
    assert analysis["models"]["b"]["second_batch"]["held_out_median_rel_error"] == pytest.approx(0.3)
    assert analysis["models"]["b"]["second_batch"]["on_other_models"]["middle"]["median_rel_error"] == pytest.approx(
        0.2
    )
    # The held-out figures pool each model under its own rule; both rules stay side by side.
    assert analysis["overall"]["partial"]["median_rel_error"] == pytest.approx(0.3)
    assert analysis["overall"]["adaptive"]["median_rel_error"] == pytest.approx(0.05)  # a's adaptive/middle unused
    assert analysis["overall"]["partial/largest"]["median_rel_error"] == pytest.approx(0.1)
    assert analysis["overall"]["partial/middle"]["median_rel_error"] == pytest.approx(0.3)


def test_equal_errors_choose_the_cheaper_rule():
    scores = {
        "largest": {"median_rel_error": 0.1, "profiling_cost_share_of_full": 0.3},
        "middle": {"median_rel_error": 0.1, "profiling_cost_share_of_full": 0.2},
    }
    assert bench.best_rule(scores) == "middle"


def test_targets_are_judged_as_ratios_to_the_noise_floor_and_every_objective_counts():
    def mode(median, time=0.0, cost=0.0, knee=0.0, share=1.0):
        return {
            "median_rel_error": median,
            "profiling_cost_share_of_full": share,
            "time_regret": time,
            "cost_regret": cost,
            "knee_regret": knee,
        }

    overall = {
        "partial": mode(0.11, time=0.02, share=0.25),
        "adaptive": mode(0.09, cost=0.04, share=0.5),
        "full": mode(0.105, knee=0.031),
    }
    targets = bench.judged(overall, noise_floor=0.1)
    assert targets["partial_median"]["figure"] == pytest.approx(1.1) and targets["partial_median"]["met"]
    assert targets["full_median"]["figure"] == pytest.approx(1.05) and not targets["full_median"]["met"]
    assert targets["time_regret"]["met"]
    assert targets["cost_regret"]["figure"] == pytest.approx(0.04) and not targets["cost_regret"]["met"]
    assert targets["knee_regret"]["figure"] == pytest.approx(0.031) and not targets["knee_regret"]["met"]
    assert targets["partial_cost_share"]["met"]
    assert set(targets) == set(bench.TARGETS)


def test_measurements_made_by_other_measuring_code_are_refused(tmp_path, monkeypatch, capsys):
    jobs = bench.bench_jobs("local")
    digest = bench.measurement_digest(jobs)
    stored = {"settings": {"launcher": "local"}, "measurement_digest": digest, "measurements": [{"round": 0}]}
    assert bench.reusable(stored, tmp_path / "same.json", digest) == [{"round": 0}]
    path = tmp_path / "old.json"
    with pytest.raises(bench.StaleMeasurements, match=f"{path}.*digest abc.*digest {digest}"):
        bench.reusable({**stored, "measurement_digest": "abc"}, path, digest)

    path.write_text('{"settings": {"launcher": "local"}, "measurements": []}')  # from before digests
    monkeypatch.setattr(sys, "argv", ["perf_accuracy.py", "--reuse", str(path)])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code != 0
    assert f"{path}: its measurements carry digest None" in capsys.readouterr().err


def test_the_digest_follows_the_measuring_code_and_the_profile_settings(monkeypatch):
    jobs = bench.bench_jobs("local")
    digest = bench.measurement_digest(jobs)
    slower = {m: job.updated(search={"steps": 8}) for m, job in jobs.items()}
    assert bench.measurement_digest(slower) != digest
    fitted = {m: job.updated(search={"noise_prior": 0.5}) for m, job in jobs.items()}
    assert bench.measurement_digest(fitted) == digest  # a fit setting does not change what was measured
    monkeypatch.setattr(bench, "MEASURING_CODE", [*bench.MEASURING_CODE, "tula_hpc/performance/estimator.py"])
    assert bench.measurement_digest(jobs) != digest


def _record(c: dict, r: int) -> dict:
    """A profile of tiny_cnn's grid: parts on lines in the batch, round r slower by 2 % per round."""
    batch, world = c["per_device_batch"], c["nodes"]
    scale = 1 + 0.02 * r
    median = {
        "data_s": 1e-4 + 1e-6 * batch,
        "compute_s": (2e-3 + 5e-5 * batch) * (1 + 0.1 * (world - 1)),
        "sync_s": 0.0 if world == 1 else 2e-3,
        "update_s": 5e-4,
    }
    median = {part: value * scale for part, value in median.items()}
    median["step_s"] = sum(median.values())
    return {
        "round": r,
        "model": "tiny_cnn",
        **c,
        "world_size": world,
        "global_batch": batch * world,
        "ranks_per_host": world,
        "grad_bytes": 4e5,
        "interference": 0.0,
        "median": median,
        "measure_wall_s": 0.5 + 10 * median["step_s"],
    }


def test_a_model_is_judged_under_both_rules_against_the_other_rounds():
    job = bench.bench_jobs("local")["tiny_cnn"]
    candidates = bench.grid(job, 1258)
    records = [_record(c, r) for r in range(3) for c in candidates]
    raw = bench.evaluate_model("tiny_cnn", job, candidates, records, 1258)
    largest = max(candidates, key=lambda c: (c["nodes"], c["batch"]))
    judged = {search: {(e["nodes"], e["batch"]) for e in raw["errors"][search]} for search in bench.SEARCHES}
    assert (largest["nodes"], largest["batch"]) not in judged["partial/largest"]  # profiled, so not judged
    assert (largest["nodes"], largest["batch"]) in judged["partial/middle"]
    assert len(raw["errors"]["full"]) == 3 * len(candidates)
    for search in bench.SEARCHES:
        shares = [c["cost_share"] for c in raw["campaigns"][search]]
        assert len(shares) == 3 and all(0 < s <= 1 for s in shares)
    assert [c["cost_share"] for c in raw["campaigns"]["full"]] == [1.0, 1.0, 1.0]
    # Truth is the median of the other rounds: round 0 (x1.00) against x1.03, round 1 (x1.02) against x1.02,
    # round 2 (x1.04) against x1.01.
    noise = {r: statistics.median(n["error"] for n in raw["noise"] if n["round"] == r) for r in range(3)}
    assert noise == pytest.approx({0: 1 - 1 / 1.03, 1: 0.0, 2: 1.04 / 1.01 - 1}, abs=1e-9)


def test_whole_runs_are_judged_over_every_profile_and_run_of_a_configuration_against_their_noise_floor(monkeypatch):
    """Three runs of 10, 11 and 12 s, each profile predicting 11 s: errors |11/m - 1| over the 9 pairs, noise floor
    the median of |m / median(others) - 1| (10 vs 11.5, 11 vs 11, 12 vs 10.5)."""
    from tula_bench import whole_run

    def predicted(job, run, train_samples):
        return {"time_s": 11.0, "epoch_time_s": [5.0, 3.0, 3.0], "steps_only_s": 9.0, "terms": {}}

    monkeypatch.setattr(whole_run, "predicted", predicted)
    runs = [
        {"model": "tiny_cnn", "nodes": 1, "per_device_batch": 32, "train_time_s": t, "epoch_time_s": [t - 6, 3.0, 3.0]}
        for t in (10.0, 11.0, 12.0)
    ]
    analysis = whole_run.analyse(runs, {"tiny_cnn": None}, {"tiny_cnn": 1258})
    whole = analysis["figures"]["whole_run"]
    assert whole["median_rel_error"] == pytest.approx(
        statistics.median(abs(11 / m - 1) for m in (10, 11, 12) for _ in "abc")
    )
    assert whole["noise_floor"] == pytest.approx(statistics.median([1 - 10 / 11.5, 0.0, 12 / 10.5 - 1]))
    assert whole["max_rel_error"] == pytest.approx(0.1)
    assert analysis["figures"]["steady_epoch"]["median_rel_error"] == 0.0
    assert analysis["figures"]["steps_only"]["median_rel_error"] == pytest.approx(1 - 9 / 11)
    assert analysis["target"]["met"] == (whole["median_rel_error"] / whole["noise_floor"] <= whole_run.WHOLE_RUN_TARGET)


def test_the_measuring_code_is_all_there():
    assert len(bench.files_digest(bench.MEASURING_CODE)) == 16  # raises, naming it, where a path is not there


def test_the_smoke_grid_holds_three_small_batches_at_each_node_count():
    job = bench.bench_jobs("local")["tiny_cnn"].updated(search=bench.SMOKE["search"])
    found = {(c["nodes"], c["per_device_batch"]) for c in bench.grid(job, 1257, smoke=True)}
    assert found == {(n, b) for n in bench.NODES for b in bench.SMOKE["per_device_batch"]}
    assert len(bench.grid(job, 1257)) > len(found)


@pytest.mark.parametrize("other", [["--reuse", "earlier.json"], ["--launcher", "slurm"]])
def test_smoke_measures_anew_on_the_local_launcher_only(other):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", *other])


def test_each_model_is_judged_on_its_own_figures_against_its_own_noise_floor():
    """A job that misses a target is named, not hidden in the pool (where the others' errors would outvote it)."""
    missed = {f"partial/{rule}": 0.5 for rule in bench.RULES}
    raw = {"a": raw_model("a", {}), "b": raw_model("b", {}), "gpt": raw_model("gpt", missed, count=1, noise=0.2)}
    analysis = bench.analyse(raw)
    assert analysis["targets"]["partial_median"]["met"]
    assert analysis["models"]["a"]["targets"]["partial_median"] == {"figure": 0.5, "target": 1.2, "met": True}
    gpt = analysis["models"]["gpt"]["targets"]
    assert gpt["partial_median"] == {"figure": pytest.approx(2.5), "target": 1.2, "met": False}
    assert gpt["time_regret"]["met"]


def test_the_gpt_job_is_the_built_in_gpt_under_adamw_on_token_windows_and_in_the_smoke_run():
    job = bench.bench_jobs("local")["gpt"]
    assert (job.model.name, job.model.kwargs["layers"], job.model.kwargs["width"]) == ("gpt", 2, 64)
    assert (job.data.seq_len, job.train.optimizer, job.train.strategy, job.task.name) == (
        64,
        "adamw",
        "lbt",
        "causal_lm",
    )
    assert bench.bench_jobs("local")["tiny_cnn"].task.name == "image_classification"  # the others keep their task
    assert "gpt" in bench.SMOKE["models"]
