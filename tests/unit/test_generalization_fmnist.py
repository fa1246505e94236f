"""bench/generalization_fmnist.py: choices made on validation, test cells planned after them, paired differences
with t intervals, and the headline over test seeds; synthetic cell records with known answers."""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tula_bench import generalization_fmnist as bench

SCALE = bench.SCALES["cpu"]
MODELS = list(SCALE["models"])


def record(phase, model, batch, strategy, seed, variant=None, test=0.8, val=0.8) -> dict:
    return dict(
        phase=phase,
        model=model,
        batch=batch,
        strategy=strategy,
        seed=seed,
        variant=variant,
        key=f"{phase}{model}{batch}{strategy}{seed}{variant}",
        test_accuracy=test,
        val_accuracy_precise_bn=val,
        steps=13 * SCALE["epochs"],
        steps_per_epoch=13,
    )


def tuning_records(best: dict[str, str]) -> list[dict]:
    """Every tuning cell; the variants in `best` score 0.9 on validation (and 0.1 on test: never looked at)."""
    return [
        record(
            "tuning",
            m,
            SCALE["tuning_batch"],
            s,
            seed,
            v,
            test=0.9 - 0.8 * (v == best[s]),
            val=0.8 + 0.1 * (v == best[s]),
        )
        for seed in SCALE["tuning_seeds"]
        for m in MODELS
        for s, variants in bench.TUNED.items()
        for v in variants
    ]


def test_each_model_chooses_the_variant_with_the_best_validation_accuracy_once_every_tuning_cell_ran():
    best = {"ags": "tensor, delta 0.2", "lars": "trust 0.001"}
    records = tuning_records(best)
    assert bench.choose(records[:-1], SCALE) is None
    assert bench.choose(records, SCALE) == {m: best for m in MODELS}


def test_test_cells_follow_the_choices_and_add_the_papers_ags_when_another_was_chosen():
    digest = "d"
    tuning = bench.plan("cpu", None, digest)
    assert {c["phase"] for c in tuning} == {"tuning"} and {c["seed"] for c in tuning} == set(SCALE["tuning_seeds"])
    chosen = {
        MODELS[0]: {"ags": bench.PAPER_AGS, "lars": "trust 0.02"},
        MODELS[1]: {"ags": "on lars, tensor, delta 0.5", "lars": "trust 0.02"},
    }
    test = [c for c in bench.plan("cpu", chosen, digest) if c["phase"] == "test"]
    per_seed = {m: 1 + 3 * 6 + (3 if chosen[m]["ags"] != bench.PAPER_AGS else 0) for m in MODELS}
    assert len(test) == len(SCALE["test_seeds"]) * sum(per_seed.values())
    assert not set(SCALE["test_seeds"]) & set(SCALE["tuning_seeds"])
    lars = {c["variant"] for c in test if c["strategy"] == "lars"}
    assert lars == {"trust 0.02"}
    # A key holds every setting and the code digest: another digest, other keys.
    assert not {c["key"] for c in tuning} & {c["key"] for c in bench.plan("cpu", None, "other")}


def test_a_paired_difference_has_its_t_interval():
    result = bench.interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert result["mean"] == 3.0 and result["n"] == 5
    half = 2.7764451051977987 * (2.5**0.5) / 5**0.5  # t(0.975, 4) x sd / sqrt(n)
    assert result["ci95"] == pytest.approx([3.0 - half, 3.0 + half])


def test_the_headline_averages_ags_minus_lbt_over_cells_per_seed_and_finds_the_worst_cell():
    """AGS beats LBT by 4 points everywhere; LRS beats AGS by 2 points at one batch of one model."""
    chosen = {m: {"ags": "on lars, tensor, delta 0.5", "lars": "trust 0.02"} for m in MODELS}
    records = []
    for seed in SCALE["test_seeds"]:
        noise = 0.001 * seed
        for m in MODELS:
            records.append(record("test", m, bench.SMALL_BATCH, "lbt", seed, test=0.9))
            for b in SCALE["large_batches"]:
                for s in bench.STRATEGIES:
                    acc = {"ags": 0.84 + noise, "lbt": 0.80 + noise}.get(s, 0.79)
                    if (m, b, s) == (MODELS[1], 4096, "lrs"):
                        acc = 0.86 + noise
                    records.append(record("test", m, b, s, seed, chosen[m].get(s), test=acc))
    table = bench.table(records, SCALE, chosen)
    cell = table[MODELS[0]]["1024"]
    assert cell["strategies"]["ags"]["mean"] == pytest.approx(84.2) and cell["strategies"]["ags"]["updates"] == 78
    assert cell["ags_minus_lbt"]["mean"] == pytest.approx(4.0) and cell["best_baseline"] == "lbt"
    headline = bench.headline(table, records, SCALE, chosen)
    assert headline["ags_minus_lbt_mean_points"]["mean"] == pytest.approx(4.0)
    assert headline["worst_ags_minus_best_baseline"]["batch"] == "4096"
    assert headline["worst_ags_minus_best_baseline"]["mean"] == pytest.approx(-2.0)
    assert headline["targets"] == {
        "ags_minus_lbt_mean_points >= 3": True,
        "ags within 1 point of the best baseline in every large-batch cell": False,
    }


def test_a_cell_key_follows_the_training_settings_and_the_code_but_not_the_search_settings():
    job = bench.cell_job("cpu", MODELS[0], "ags", 0, bench.PAPER_AGS)
    key = bench.cell_key(job, 1024, 2, "d")
    elsewhere = job.updated(search={"mode": "full", "steps": 7}, objective={"minimize": "time", "pricing": "memory"})
    assert elsewhere.search != job.search and elsewhere.objective != job.objective
    assert bench.cell_key(elsewhere, 1024, 2, "d") == key
    other = job.updated(train={"ags": {"delta": 0.2}})
    assert (
        len(
            {
                key,
                bench.cell_key(other, 1024, 2, "d"),
                bench.cell_key(job, 2048, 2, "d"),
                bench.cell_key(job, 1024, 2, "e"),
            }
        )
        == 4
    )


class FakeCells:
    """run_cells' `run`: records the cells in the order they start with the cells running then, each scoring 0.8."""

    def __init__(self):
        self.lock, self.started, self.running, self.beside = threading.Lock(), [], [], []

    def __call__(self, cell, scale_name, scratch):
        with self.lock:
            self.started.append(cell)
            self.beside.append([c["phase"] for c in self.running])
            self.running.append(cell)
        time.sleep(0.002)
        with self.lock:
            self.running.remove(cell)
        return {**cell, "test_accuracy": 0.8, "val_accuracy_precise_bn": 0.8, "steps": 78, "steps_per_epoch": 13}


def test_the_runner_runs_each_planned_cell_once_side_by_side_and_the_test_cells_after_the_last_tuning_cell(tmp_path):
    cells_path, run = tmp_path / "cells.jsonl", FakeCells()
    with ThreadPoolExecutor(3) as pool:
        ran = bench.run_cells(pool, 3, cells_path, "cpu", tmp_path, run=run)
    records, chosen, cells = bench.planned_cells(cells_path, "cpu", bench.code_digest())
    assert chosen is not None and ran == len(cells) == len(records)
    assert sorted(r["key"] for r in records) == sorted(c["key"] for c in cells)
    assert max(map(len, run.beside)) == 2  # two running beside a third
    # No test cell starts before the last tuning cell has finished.
    assert all("tuning" not in beside for cell, beside in zip(run.started, run.beside) if cell["phase"] == "test")
    assert [c["phase"] for c in run.started].index("test") == len(bench.plan("cpu", None, bench.code_digest()))
    # Nothing left: a rerun starts no cell.
    with ThreadPoolExecutor(3) as pool:
        assert bench.run_cells(pool, 3, cells_path, "cpu", tmp_path, run=run) == 0


def test_the_runner_starts_no_cell_past_its_count_or_its_deadline_and_a_rerun_continues(tmp_path):
    cells_path, run = tmp_path / "cells.jsonl", FakeCells()
    with ThreadPoolExecutor(2) as pool:
        assert bench.run_cells(pool, 2, cells_path, "cpu", tmp_path, max_cells=5, run=run) == 5
        assert bench.run_cells(pool, 2, cells_path, "cpu", tmp_path, deadline=time.perf_counter() - 1, run=run) == 0
        assert bench.run_cells(pool, 2, cells_path, "cpu", tmp_path, max_cells=4, run=run) == 4
    keys = [c["key"] for c in run.started]
    assert len(set(keys)) == 9 and keys == [c["key"] for c in bench.plan("cpu", None, bench.code_digest())[:9]]


def test_smoke_runs_one_cell_of_the_smoke_scale_with_its_cache_in_a_temporary_folder():
    args = argparse.Namespace(smoke=True, scale="cpu", max_cells=None, scratch=None, out=bench.RESULTS / "x.json")
    cells = bench.cells_file(args, bench.RESULTS / "x.json")
    assert (args.scale, args.max_cells) == ("smoke", 1) and cells.parent == args.scratch
    assert bench.RESULTS not in cells.parents
    job = bench.cell_job("smoke", "bn_cnn", "ags", 100, bench.PAPER_AGS)  # validated, on digits
    assert job.data.name == "digits" and job.train.epochs == bench.SCALES["smoke"]["epochs"]


def test_a_scale_other_than_cpu_caches_and_writes_under_its_own_name():
    default = bench.RESULTS / "generalization_fmnist.json"
    args = argparse.Namespace(smoke=False, scale="gpu", max_cells=None, scratch=None, out=default)
    assert bench.cells_file(args, default).name == "generalization_fmnist_cells-gpu.jsonl"
    assert args.out.name == "generalization_fmnist-gpu.json"
