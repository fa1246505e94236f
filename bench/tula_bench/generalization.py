"""The paper's Table I on what runs here: test accuracy of every strategy at global batches 256, 512, 1024.

Every cell is the real training loop (tula_hpc.stages.train.train_worker with its strategy hooks) on 2 ranks
(DDP, gloo, 1 thread each), launched as the train stage launches it (tula_hpc.cluster.launch, one job per
cell), so polo runs PyTorch's post-local SGD and ags averages its factors over ranks as on a cluster;
the evaluate stage's worker scores it. Data: scikit-learn's digits (1257 training images) with the job's seeded split
(a seed changes the split, the initial weights and the shuffling). A run is a model at a budget of
epochs that every batch of it trains, with the default job's LR milestones at the same fractions,
plus a small-batch (32) lbt reference. Default runs: the tiny CNN (8x8) at 10 epochs (where the small
batch has just converged) and at 30 (the default job), and mobilenet_v3_small (32x32) at 10 epochs.

Test accuracy is scored twice: as trained, and after recomputing BatchNorm statistics over the
training set with the final weights (precise BN), the headline. torchvision's MobileNetV3 uses BN
momentum 0.01, so after the few dozen steps of a large batch its running statistics still describe
the initial weights and every cell scores near chance as trained; precise BN scores the weights.
The tiny CNN has no BN: both scores agree.

Writes bench/results/generalization.json: mean and std over seeds per cell, ags_minus_lbt_mean_points
(AGS minus LBT averaged over runs and batches, accuracy points), AGS against the best baseline (lbt,
lrs, lars, polo) per run and batch, and an ablation of the AGS knobs (delta, s_min, granularity) on
the first run of each model. Finished cells are kept in work/bench/generalization/cells.jsonl, so an
interrupted bench continues where it stopped (--fresh starts over). Run it under
`flock /tmp/tula-cpu.lock`. `--smoke` trains SMOKE's two cells (the small-batch reference and AGS at one batch, one
epoch, one seed) in a fresh temporary folder: the continuous-integration check that the bench runs end to end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

from tula_bench.common import (
    WORK,
    bench_job,
    bench_parser,
    parse_bench_args,
    smoke_scratch,
    train_cell,
    trained_scores,
    write_result,
)
from tula_hpc.core.atomic_files import append_jsonl, read_jsonl, write_jsonl
from tula_hpc.core.job import Job
from tula_hpc.training.datasets import load_splits
from tula_hpc.training.strategies import STRATEGIES

WORLD = 2
BATCHES = (256, 512, 1024)
SMALL_BATCH = 32
BASELINES = ("lbt", "lrs", "lars", "polo")
IMAGE_SIZE = {"tiny_cnn": 8, "mobilenet_v3_small": 32}
DEFAULT_RUNS = ("tiny_cnn:10", "tiny_cnn:30", "mobilenet_v3_small:10")
# AGS knobs varied one at a time from the defaults, on the first run of each model.
ABLATION = {
    "delta=0.2": {"delta": 0.2},
    "delta=0.8": {"delta": 0.8},
    "delta=inf (always scale)": {"delta": 1e9},
    "granularity=element (paper)": {"granularity": "element"},
    "s_min=1 (never shrink)": {"s_min": 1.0},
}
ABLATION_BATCHES = (256, 1024)
# --smoke: the fewest cells that still train, score and compare (the small-batch reference and one strategy)
SMOKE = {"runs": ["tiny_cnn:1"], "seeds": 1, "batches": [256], "strategies": ["ags"], "ablation": False}


def cell_job(cell: dict) -> Job:
    epochs = cell["epochs"]
    return bench_job(
        as_name="bench-generalization",
        model={"name": cell["model"]},
        data={"image_size": IMAGE_SIZE[cell["model"]]},
        train={
            "epochs": epochs,
            "strategy": cell["strategy"],
            "seed": cell["seed"],
            # The default job decays at 2/3 and 5/6 of its 30 epochs; keep those fractions.
            "lr_milestones": [round(epochs * 2 / 3), round(epochs * 5 / 6)],
            "ags": cell["ags"],
        },
    )


def plan_cells(
    runs: list[str], seeds: int, ablation: bool, ags_defaults: dict, batches: list[int], strategies: list[str]
) -> list[dict]:
    """Seed-major, so that a partial bench already covers every cell once.

    The key of an ags or static cell names its scaling settings, so a change of the job's defaults reruns
    those cells instead of reusing finished ones made under the old settings.
    """
    ablation_runs = [
        run for i, run in enumerate(runs) if ablation and run.split(":")[0] not in {r.split(":")[0] for r in runs[:i]}
    ]
    cells = []
    for seed in range(seeds):
        for run in runs:
            cells.append(dict(run=run, batch=SMALL_BATCH, strategy="lbt", variant="small-batch", seed=seed, ags={}))
            cells += [
                dict(run=run, batch=b, strategy=s, variant="default", seed=seed, ags={})
                for b in batches
                for s in strategies
            ]
        cells += [
            dict(run=run, batch=b, strategy="ags", variant=name, seed=seed, ags=knobs)
            for run in ablation_runs
            for b in ABLATION_BATCHES
            for name, knobs in ABLATION.items()
        ]
    for cell in cells:
        model, epochs = cell["run"].split(":")
        scaling = ""
        if cell["strategy"] in ("ags", "static"):
            settings = json.dumps({**ags_defaults, **cell["ags"]}, sort_keys=True)
            scaling = "|" + hashlib.sha256(settings.encode()).hexdigest()[:8]
        cell.update(
            model=model,
            epochs=int(epochs),
            key=f"{cell['run']}|B{cell['batch']}|{cell['strategy']}|{cell['variant']}|seed{cell['seed']}{scaling}",
        )
    return cells


def cell_dir(scratch: Path, key: str) -> Path:
    return scratch / key.replace("|", "_").replace(":", "_").replace(" ", "_")


def rescore(records: list[dict], cells: list[dict], scratch: Path) -> list[dict]:
    """Score finished cells of the plan again from their saved models (after a change of scoring; no training)."""
    planned = {c["key"]: c for c in cells}
    return [
        {**r, **trained_scores(cell_job(planned[r["key"]]), cell_dir(scratch, r["key"]) / "model.pt")}
        if r["key"] in planned
        else r
        for r in records
    ]


def run_cell(cell: dict, scratch: Path) -> dict:
    """One cell as the train stage runs it: train_worker on WORLD ranks, a job of its own (launch.run).

    A cell interrupted earlier resumes from its checkpoint, which gives the uninterrupted result.
    """
    job = cell_job(cell)
    run_dir = cell_dir(scratch, cell["key"])
    started = time.perf_counter()
    summary = train_cell(job, cell["batch"], run_dir, WORLD, "bench-generalization")
    scaled = [r["ags"]["scaled_fraction"] for r in summary["history"] if "ags" in r]
    record = {
        **{k: cell[k] for k in ("key", "run", "model", "epochs", "batch", "strategy", "variant", "seed")},
        **trained_scores(job, run_dir / "model.pt"),
        "val_accuracy": summary["history"][-1]["val_accuracy"],
        "steps": summary["steps"],
        "train_time_s": summary["train_time_s"],
        "wall_s": time.perf_counter() - started,
        "scaled_fraction": statistics.fmean(scaled) if scaled else None,
    }
    print(
        f"{cell['key']:60s} test {record['test_accuracy']:.4f}"
        f" (as trained {record['test_accuracy_as_trained']:.4f}, {record['wall_s']:.1f} s)",
        flush=True,
    )
    return record


def summarise(records: list[dict]) -> dict:
    values = [r["test_accuracy"] for r in records]
    raw = [r["test_accuracy_as_trained"] for r in records]
    scaled = [r["scaled_fraction"] for r in records if r["scaled_fraction"] is not None]
    val = [r["val_accuracy_precise_bn"] for r in records if "val_accuracy_precise_bn" in r]
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
        "values": values,
        "as_trained_mean": statistics.fmean(raw),
        **({"val_mean": statistics.fmean(val)} if val else {}),
        **({"scaled_fraction_mean": statistics.fmean(scaled)} if scaled else {}),
    }


def aggregate(records: list[dict], runs: list[str], batches: list[int]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["run"], r["batch"], r["strategy"], r["variant"]), []).append(r)
    cell = {key: summarise(rs) for key, rs in groups.items()}
    table = {
        run: {
            str(b): {s: cell[(run, b, s, "default")] for s in STRATEGIES if (run, b, s, "default") in cell}
            for b in batches
        }
        for run in runs
    }
    versus_best, versus_lbt = {}, {}
    for run in runs:
        for b in batches:
            row = table[run][str(b)]
            if "ags" not in row or not all(s in row for s in BASELINES):
                continue
            best = max(BASELINES, key=lambda s: row[s]["mean"])
            versus_best.setdefault(run, {})[str(b)] = {
                "best_baseline": best,
                "ags_minus_best_points": 100 * (row["ags"]["mean"] - row[best]["mean"]),
            }
            versus_lbt.setdefault(run, {})[str(b)] = 100 * (row["ags"]["mean"] - row["lbt"]["mean"])
    all_vs_lbt = [v for per_run in versus_lbt.values() for v in per_run.values()]
    all_vs_best = [g["ags_minus_best_points"] for per_run in versus_best.values() for g in per_run.values()]
    mean_vs_lbt = statistics.fmean(all_vs_lbt) if all_vs_lbt else None
    ablation = {}
    for (run, b, strategy, variant), stats in cell.items():
        if strategy == "ags" and b in ABLATION_BATCHES and (variant in ABLATION or variant == "default"):
            ablation.setdefault(run, {}).setdefault(str(b), {})[variant] = stats
    return {
        "table": table,
        "small_batch_reference": {
            run: cell[(run, SMALL_BATCH, "lbt", "small-batch")]
            for run in runs
            if (run, SMALL_BATCH, "lbt", "small-batch") in cell
        },
        "ags_minus_lbt_mean_points": mean_vs_lbt,
        "ags_minus_lbt_points": versus_lbt,
        "ags_vs_best_baseline": versus_best,
        "targets": {
            "ags_minus_lbt_mean_points >= 3": mean_vs_lbt is not None and mean_vs_lbt >= 3,
            "ags within 1 point of the best baseline at every run and batch": bool(all_vs_best)
            and min(all_vs_best) >= -1,
        },
        "ablation": {run: per_run for run, per_run in ablation.items() if any(len(v) > 1 for v in per_run.values())},
    }


def print_table(result: dict) -> None:
    for run, rows in result["table"].items():
        ref = result["small_batch_reference"].get(run)
        print(
            f"\n{run}  (small batch {SMALL_BATCH}: "
            + (f"{100 * ref['mean']:.2f} +- {100 * ref['std']:.2f})" if ref else "-)")
        )
        print("batch  " + "".join(f"{s:>15s}" for s in STRATEGIES))
        for batch, row in rows.items():
            print(
                f"{batch:>5s}  "
                + "".join(
                    f"{100 * row[s]['mean']:8.2f} +-{100 * row[s]['std']:5.2f}" if s in row else f"{'-':>15s}"
                    for s in STRATEGIES
                )
            )
    print(f"\nags - lbt (points): {result['ags_minus_lbt_points']}; mean {result['ags_minus_lbt_mean_points']}")
    print(f"ags vs best baseline: {result['ags_vs_best_baseline']}")
    print(f"targets: {result['targets']}")
    for run, per_batch in result["ablation"].items():
        for batch, variants in per_batch.items():
            print(
                f"ablation {run} B={batch}: "
                + ", ".join(
                    f"{v}: {100 * s['mean']:.2f} +- {100 * s['std']:.2f}"
                    f" (val {100 * s.get('val_mean', float('nan')):.2f})"
                    for v, s in variants.items()
                )
            )


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "generalization.json")
    parser.add_argument(
        "--runs", nargs="+", default=list(DEFAULT_RUNS), help="model:epochs, model in " + ", ".join(IMAGE_SIZE)
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="global batches of the table")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--no-ablation", dest="ablation", action="store_false")
    parser.add_argument("--scratch", type=Path, default=WORK / "generalization", help="finished cells and their runs")
    parser.add_argument("--fresh", action="store_true", help="forget finished cells and start over")
    parser.add_argument("--rescore", action="store_true", help="score finished cells again from their saved models")
    parser.add_argument("--smoke", action="store_true", help="the smallest case (SMOKE) in a temporary folder")
    args = parse_bench_args(parser, argv)
    if args.smoke:
        vars(args).update(SMOKE, scratch=smoke_scratch("generalization"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    done_path = args.scratch / "cells.jsonl"
    if args.fresh:
        done_path.unlink(missing_ok=True)
    base = bench_job()
    splits = load_splits(base.data, base.train.seed)  # sizes only: each seed splits anew
    plain = base.as_dict()
    cells = plan_cells(args.runs, args.seeds, args.ablation, plain["train"]["ags"], args.batches, args.strategies)
    if args.rescore and done_path.exists():
        write_jsonl(done_path, rescore(read_jsonl(done_path), cells, args.scratch))
    done = {r["key"] for r in read_jsonl(done_path)} if done_path.exists() else set()
    todo = [c for c in cells if c["key"] not in done]
    print(f"{len(cells)} cells, {len(todo)} to run", flush=True)
    started = time.perf_counter()
    for cell in todo:
        append_jsonl(done_path, run_cell(cell, args.scratch))
    wanted = {c["key"] for c in cells}
    records = [r for r in {r["key"]: r for r in read_jsonl(done_path)}.values() if r["key"] in wanted]
    settings = {
        "smoke": args.smoke,
        "data": {
            "name": base.data.name,
            **{part: len(getattr(splits, part)) for part in ("train", "val", "test")},
        },
        "world_size": WORLD,
        "threads_per_rank": base.resources.cpus_per_task,
        "runs": args.runs,
        "seeds": args.seeds,
        "batches": args.batches,
        "strategies": args.strategies,
        "small_batch": SMALL_BATCH,
        "image_size": IMAGE_SIZE,
        "lr_milestones": "at 2/3 and 5/6 of the epochs",
        "ablation": ABLATION if args.ablation else None,
        "baselines": list(BASELINES),
        "score": "test_accuracy = after precise BN (BN statistics recomputed on the training set); "
        "as_trained_mean = with the running statistics training left",
        "job": plain,
    }
    figures = {
        **aggregate(records, args.runs, args.batches),
        "cells": records,
        "wall_time_s": time.perf_counter() - started,
    }
    write_result(args.out, settings, figures)
    print_table(figures)
    print(f"\n{figures['wall_time_s']:.0f} s for {len(todo)} cells")
