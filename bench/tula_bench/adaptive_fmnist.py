"""Benchmark: the adaptive batch schedule in training on Fashion-MNIST (issue 42, part 3), against the B=128 reference.

Table I's regime as bench/efficiency_fmnist.py runs it (generalization_fmnist's scale cpu: bn_cnn at 14x14, 6 epochs
at B=128 with decays at epochs 4 and 5, two gloo ranks of one core, test accuracy after precise BN):
- reference: lbt at B=128 for the recipe's 6 epochs;
- adaptive: train.batch_schedule adaptive from the DAG's own goodput choice (efficiency_fmnist.choose_by_goodput:
  snakemake up to selection.json on a tuning seed, search over batches 32 to 4096 on this machine's 2 ranks),
  choosing the batch again every 20th of the run (the first epoch's decisions included: issue 58) and at each epoch's
  end among perfmodel.json's candidates at the chosen node count by the noise scale the run has measured
  (batch_schedule.BatchSchedule, the train stage's own).
The setting the tuning seeds choose (generalization_fmnist's, 100 and 101, by validation accuracy after precise BN,
then fewer steps): the strategy that carries the batch from change to change, adascale (the rate times the gain, to
the recipe's progress) or lrs (the recipe's epochs, the rate linear in the batch). The 5 test seeds choose nothing:
differences from the reference are paired over them (a seed fixes the split, the weights and the data order), with
95 % t intervals; steps are optimizer steps (summary's optimizer_steps), time the train stage's train_time_s.
Cells are cached in bench/results/adaptive_fmnist_cells.jsonl under generalization_fmnist's key (the training
settings and the training code's digest) and the candidates' digest, so a stopped run continues.
On 2 CPU cores a step's time grows about linearly with its batch, so the goodput choice stays near
sqrt(latency x B_noise / time per sample): this is the regime's accuracy check, not where large batches pay
(bench/goodput_replay.py replays that on GPU curves).

`--smoke` runs the same code at generalization_fmnist's smoke scale (digits at 8x8, two epochs, a narrow bn_cnn; the
DAG's search over batches 32 and 64 at its fewest steps), adascale alone tuned, one tuning and one test seed, in a
fresh temporary folder with its cells file: the continuous-integration check that the bench runs end to end (about
a minute and a half here; its targets mean nothing there).

Run:  .venv/bin/python bench/adaptive_fmnist.py [--scratch DIR] [--out FILE] [--smoke]   (about 15 minutes here)
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tula_bench.common import (
    RESULTS,
    bench_parser,
    parse_bench_args,
    provenance,
    smoke_scratch,
    train_cell,
    trained_scores,
    write_and_report,
)
from tula_bench.efficiency_fmnist import CHOICE_JOB, WORLD, choice_digest, choose_by_goodput
from tula_bench.generalization_fmnist import SCALES, SMALL_BATCH, cell_job, cell_key, code_digest, interval
from tula_hpc.core.atomic_files import append_jsonl, read_json, read_jsonl
from tula_hpc.core.job import Job
from tula_hpc.performance.batch_schedule import BatchSchedule

SCALE, MODEL = "cpu", "bn_cnn"
CELLS = RESULTS / "adaptive_fmnist_cells.jsonl"
STRATEGIES = ("adascale", "lrs")  # what the tuning seeds choose between
ACCURACY_MARGIN = 0.5  # points: the 95 % interval's lower bound of adaptive - reference at least -0.5


@dataclass(frozen=True)
class Regime:
    """The generalization_fmnist scale the cells train at, the file caching them and the strategies tuned: the full
    run's, or --smoke's (the smoke scale, its cells in a fresh scratch folder, so no smoke cell enters bench/results,
    and adascale alone: the tuning's code runs the same over one strategy)."""

    scale: str = SCALE
    cells: Path = CELLS
    strategies: tuple[str, ...] = STRATEGIES

    @classmethod
    def smoke(cls, scratch: Path) -> Regime:
        return cls("smoke", scratch / "cells.jsonl", ("adascale",))


def adaptive_job(strategy: str, seed: int, scale: str = SCALE) -> Job:
    """The recipe's cell with the adaptive schedule, following the goodput objective."""
    job = cell_job(scale, MODEL, strategy, seed, None)
    return job.updated(train={"batch_schedule": "adaptive"}, objective={"minimize": "goodput"})


def job_of(kind: str, strategy: str, seed: int, scale: str = SCALE) -> Job:
    return adaptive_job(strategy, seed, scale) if kind != "reference" else cell_job(scale, MODEL, "lbt", seed, None)


def the_choice(scratch: Path, regime: Regime) -> dict:
    """The DAG's goodput choice and perfmodel.json's candidates at its node count (cached with the DAG's digest)."""
    records = read_jsonl(regime.cells) if regime.cells.exists() else []
    digest = choice_digest(MODEL, regime.scale)
    found = [r for r in records if r["phase"] == "choice" and r["code_digest"] == digest]
    if found:
        return found[-1]
    folder = scratch / "dag"
    choice = choose_by_goodput(MODEL, folder, regime.scale)
    perfmodel = read_json(folder / f"results/{CHOICE_JOB}/perfmodel.json")
    chosen = {"nodes": choice["nodes"], "batch": choice["batch"], "gpus_per_node": 0}
    rows = list(BatchSchedule.for_run(adaptive_job("adascale", 0, regime.scale), perfmodel, chosen).rows)
    record = {
        **choice,
        "code_digest": digest,
        "train_samples": perfmodel["train_samples"],
        "candidates": rows,
        "candidates_digest": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:12],
    }
    append_jsonl(regime.cells, record)
    return record


def run_cell(cell: dict, choice: dict, scratch: Path, scale: str) -> dict:
    adaptive = cell["kind"] != "reference"
    job = job_of(cell["kind"], cell["strategy"], cell["seed"], scale)
    worker = {}
    if adaptive:
        worker["schedule"] = BatchSchedule(job, tuple(choice["candidates"]), choice["train_samples"])
    started = time.perf_counter()
    summary = train_cell(job, cell["batch"], scratch / cell["key"], WORLD, "bench-adaptive-fmnist", **worker)
    ran = [h["batch_schedule"]["ran"]["global_batch"] for h in summary["history"] if "batch_schedule" in h]
    record = {
        **cell,
        **trained_scores(job, scratch / cell["key"] / "model.pt"),
        "epochs": summary["epochs"],
        "steps": summary["optimizer_steps"],
        "train_time_s": summary["train_time_s"],
        "batches": ran or [cell["batch"]] * summary["epochs"],
        "b_noise": [(h.get("noise_scale") or {}).get("b_noise") for h in summary["history"]],
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"{cell['phase']:6s} {cell['kind']:9s} {cell['strategy']:8s} seed {cell['seed']:3d}: test "
        f"{record['test_accuracy']:.4f}, val {record['val_accuracy_precise_bn']:.4f}, {record['steps']} steps, "
        f"{record['train_time_s']:.0f} s, batches {record['batches']}",
        flush=True,
    )
    return record


def cell(phase: str, kind: str, strategy: str, seed: int, batch: int, choice: dict, digest: str, scale: str) -> dict:
    key = cell_key(
        job_of(kind, strategy, seed, scale),
        batch,
        WORLD,
        digest + (choice["candidates_digest"] if kind != "reference" else ""),
    )
    return dict(phase=phase, kind=kind, strategy=strategy, seed=seed, batch=batch, key=key)


def tuned_strategy(tuning: list[dict], strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """The strategy with the best mean validation accuracy over the tuning seeds (then the fewer steps)."""
    scores = {
        s: (
            statistics.fmean(r["val_accuracy_precise_bn"] for r in tuning if r["strategy"] == s),
            -statistics.fmean(r["steps"] for r in tuning if r["strategy"] == s),
        )
        for s in strategies
    }
    best = max(strategies, key=lambda s: scores[s])
    return {"strategy": best, "validation": {s: {"val_accuracy": v, "steps": -n} for s, (v, n) in scores.items()}}


def run(scratch: Path, regime: Regime = Regime()) -> dict:
    digest, scale, cells = code_digest(), regime.scale, regime.cells
    choice = the_choice(scratch, regime)
    done = {r["key"]: r for r in (read_jsonl(cells) if cells.exists() else []) if r["phase"] != "choice"}

    def ran(phase: str, kind: str, strategy: str, seed: int, batch: int) -> dict:
        planned = cell(phase, kind, strategy, seed, batch, choice, digest, scale)
        if planned["key"] not in done:
            done[planned["key"]] = run_cell(planned, choice, scratch, scale)
            append_jsonl(cells, done[planned["key"]])
        return done[planned["key"]]

    start = choice["batch"]
    tuning_seeds, test_seeds = SCALES[scale]["tuning_seeds"], SCALES[scale]["test_seeds"]
    tuning = [ran("tune", "adaptive", s, seed, start) for s in regime.strategies for seed in tuning_seeds]
    tuned = tuned_strategy(tuning, regime.strategies)
    reference = [ran("test", "reference", "lbt", seed, SMALL_BATCH) for seed in test_seeds]
    adaptive = [ran("test", "adaptive", tuned["strategy"], seed, start) for seed in test_seeds]
    return figures(reference, adaptive, tuning, tuned, choice, regime)


def figures(
    reference: list[dict],
    adaptive: list[dict],
    tuning: list[dict],
    tuned: dict,
    choice: dict,
    regime: Regime = Regime(),
) -> dict:
    by_seed = {r["seed"]: r for r in reference}
    accuracy = interval([100 * (r["test_accuracy"] - by_seed[r["seed"]]["test_accuracy"]) for r in adaptive])
    steps = statistics.median(r["steps"] / by_seed[r["seed"]]["steps"] for r in adaptive)
    time_ratio = statistics.median(r["train_time_s"] / by_seed[r["seed"]]["train_time_s"] for r in adaptive)
    summary = {
        "fmnist_adaptive_accuracy_minus_reference": accuracy,
        "fmnist_adaptive_steps_over_reference": steps,
        "fmnist_adaptive_time_over_reference": time_ratio,
        "fmnist_reference_steps_median": statistics.median(r["steps"] for r in reference),
        "fmnist_adaptive_steps_median": statistics.median(r["steps"] for r in adaptive),
    }
    return {
        "summary": summary,
        "verdicts": {
            "accuracy_lower_bound_at_least_minus_0.5_points": {
                "met": bool(accuracy["ci95"][0] >= -ACCURACY_MARGIN),
                "figure": accuracy["ci95"][0],
                "target": -ACCURACY_MARGIN,
            },
            "median_steps_below_the_reference": {
                "met": summary["fmnist_adaptive_steps_median"] < summary["fmnist_reference_steps_median"],
                "figure": summary["fmnist_adaptive_steps_median"],
                "target": f"< {summary['fmnist_reference_steps_median']}",
            },
        },
        "tuned": tuned,
        "choice": {k: choice[k] for k in ("batch", "nodes", "noise_scale", "measuring_wall_s", "candidates_digest")},
        "reference": reference,
        "adaptive": adaptive,
        "tuning": tuning,
        "provenance": provenance(),
        "settings": {
            "scale": regime.scale,
            "smoke": regime.scale == "smoke",
            "model": MODEL,
            "world_size": WORLD,
            "reference_batch": SMALL_BATCH,
            "strategies_tuned": list(regime.strategies),
            "regime": {k: SCALES[regime.scale][k] for k in ("image_size", "epochs", "tuning_seeds", "test_seeds")},
        },
    }


def report(result: dict) -> None:
    s = result["summary"]
    acc = s["fmnist_adaptive_accuracy_minus_reference"]
    print(f"tuned strategy: {result['tuned']['strategy']} ({result['tuned']['validation']})")
    print(
        f"adaptive - reference: {acc['mean']:+.2f} points [{acc['ci95'][0]:+.2f}, {acc['ci95'][1]:+.2f}] over "
        f"{acc['n']} seeds; steps {s['fmnist_adaptive_steps_median']} vs {s['fmnist_reference_steps_median']} "
        f"({s['fmnist_adaptive_steps_over_reference']:.2f}x); time {s['fmnist_adaptive_time_over_reference']:.2f}x"
    )
    for key, v in result["verdicts"].items():
        print(f"{key}: {v['figure']} (target {v['target']}): {'met' if v['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "adaptive_fmnist.json")
    parser.add_argument("--scratch", type=Path, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help="the smoke scale, its cells in a temporary folder")
    args = parse_bench_args(parser, argv)
    if args.smoke:
        scratch = smoke_scratch("adaptive-fmnist")
        return write_and_report(args.out, run(scratch, Regime.smoke(scratch)), report)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="adaptive-fmnist-"))
    return write_and_report(args.out, run(scratch), report)
