"""Benchmark: large batches for a language model (issue 58, part 4), judged by optimizer steps to a target loss.

The GPT of config/examples/shakespeare-gpt.yaml (4 layers x 128, T = 64, AdamW with betas 0.9/0.95, weight decay
0.1, gradient clip 1.0) on the Shakespeare corpus, 2 gloo ranks (train_cell, as the train stage runs it), B0 = 16
sequences (global). Every arm trains the recipe's token count with a cosine rate laid over it (its warm-up the same
share of the tokens, expressed as lr_schedule.warmup_steps at the arm's starting batch) and validates on the same
train.val_samples windows every fixed number of tokens. Arms:
- recipe: lbt at B0 (lr 2e-3);
- large: lrs at 8 x B0 (the square-root rate from lr_base_batch = B0);
- ags: AGS's Adam form on lbt at 8 x B0 (one factor per tensor); ags_group and ags_model: the same with one factor
  per kind of parameter (train.ags.granularity group) and one for all (model), measured against each other;
- adascale: AdaptDL's Adam form at 8 x B0 (lr_base_batch = B0); adaptive_adascale: the adaptive schedule carried by
  adascale, to the recipe's progress rather than its tokens (the summary's adaptive_* figures are the adaptive arm's;
  adaptive_adascale_* beside them);
- ramp: lrs, the global batch doubled from B0 to 8 x B0 in equal token stretches over the first 20 % of the tokens;
- adaptive: lrs from B0, train.batch_schedule adaptive deciding every 20th of the run (train.batch_schedule_every
  null); adaptive_reset: the same with Adam's moments zeroed at each change (train.adam_moments_on_batch_change).
The adaptive arms choose with a GPU cluster's step-time model, not this machine's: on 2 cores a step's time grows
with its batch and goodput keeps the batch small. The model is Pollux's CIFAR-10 trace (bench/data/pollux, T4 GPUs)
at placement "11", two nodes of one GPU each (2 ranks, as here), a sequence counted as SAMPLES_PER_SEQUENCE of the
trace's samples so that B0 sits at the trace's smallest per-GPU batch; its step grows 1.3x from B0 to 4 x B0 and
1.9x to 8 x B0, the regime where large batches pay (the recorded H200 runs, bench/data/gpu, hold one batch per run).
The target per seed: the recipe's final validation loss x 1.01; steps and tokens to it interpolated linearly between
the two validations around the crossing; wall time to it the run's train_time_s scaled by the share of its tokens
(a CPU step's time is about linear in its tokens). Steps and tokens are judged, wall time reported. Paired seeds fix
the initial weights, the data order and the validation subset for every arm alike; 95 % t intervals over them.

Cells are cached in bench/results/lm_large_batch_cells.jsonl under generalization_fmnist's key (the train stage's
settings, the batch, the ranks, the training code's digest; the candidates' digest for the adaptive arms), so a
stopped run continues cell by cell. `--arms` runs some arms only (the summary's figures that need the others are
null). `--smoke` runs every arm at a tiny scale (the first 200,000 training characters, a few thousand tokens, one
seed) in a fresh temporary folder with its own cells file: the continuous-integration check (about a minute).

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/lm_large_batch.py [--arms A ...] [--scratch DIR]
      (about 75 minutes here; the estimate is printed first; writes bench/results/lm_large_batch.json and .png)
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from tula_bench.common import (
    BENCH,
    REPO,
    RESULTS,
    bench_parser,
    merged,
    parse_bench_args,
    provenance,
    smoke_scratch,
    train_cell,
)
from tula_bench.generalization_fmnist import cell_key, code_digest, interval
from tula_hpc.config import job_settings, validate_config
from tula_hpc.core.atomic_files import append_jsonl, read_jsonl, write_json
from tula_hpc.core.job import Job

EXAMPLE = REPO / "config" / "examples" / "shakespeare-gpt.yaml"
NAME = "bench-lm-large-batch"
CELLS = RESULTS / "lm_large_batch_cells.jsonl"
TRACE = BENCH / "data" / "pollux" / "cifar10" / "placements.csv"
WORLD = 2
B0 = 16  # sequences, global
LARGE = 8 * B0
LR = 2e-3  # the example's peak rate, here at B0
WARMUP_SHARE = 0.02  # of the run's tokens
RAMP_SHARE = 0.2  # of the run's tokens, B0 -> 8 x B0 by doublings
TARGET_FACTOR = 1.01  # the recipe's final validation loss x 1.01
SAMPLES_PER_SEQUENCE = 4  # B0 / 2 ranks = 8 sequences per GPU <-> the trace's smallest per-GPU batch, 32 images
GPU_PLACEMENT = "11"  # two nodes of one T4 each: 2 ranks
# Timed here (2 ranks; 200 steps at B0 on a quiet machine, 100 at 8 x B0 with other agents' tests running): seconds
# per 1000 training tokens, and a cell's start (processes, data, validations). What the printed estimate uses.
SECONDS_PER_KTOKEN = {B0: 0.088, LARGE: 0.117}
CELL_START_S = 15.0
# Tokens and validation spacing multiples of 8 x B0 x T = 8192 tokens, so that every arm's steps are whole. full:
# 180 steps at 8 x B0 (1440 at B0), a third of an epoch of the training works, 36 validations; 30 cells in about
# 50 minutes measured on the first run (adascale trains past the tokens, to the recipe's progress: 3 to 4 minutes).
SCALES = {
    "full": {
        "tokens": 1_474_560,
        "val_every_tokens": 40_960,
        "train_characters": None,
        # not 0-2: their cells (before AGS profiled within a run shorter than an epoch) shaped the arms below
        "seeds": [10, 11, 12],
        "val_samples": 256,
    },
    "smoke": {
        "tokens": 32_768,
        "val_every_tokens": 8_192,
        "train_characters": 200_000,
        "seeds": [0],
        "val_samples": 16,
    },
}
ARMS = (
    "recipe",
    "large",
    "ags",
    "adascale",
    "ramp",
    "adaptive",
    "adaptive_reset",
    "ags_group",
    "ags_model",
    "adaptive_adascale",
)
MOVING = {"ramp", "adaptive", "adaptive_reset", "adaptive_adascale"}  # arms whose batch changes during the run
ADAPTIVE = {"adaptive", "adaptive_reset", "adaptive_adascale"}


def selected_batch(arm: str) -> int:
    """The global batch the run is given (the ramp's is where it ends; the adaptive arms' where they start)."""
    return B0 if arm in ("recipe", *ADAPTIVE) else LARGE


def first_batch(arm: str) -> int:
    """The global batch of the run's first steps, at which its warm-up is counted in steps."""
    return B0 if arm in ("recipe", "ramp", *ADAPTIVE) else LARGE


def arm_train(arm: str) -> dict:
    """The arm's train settings besides the run's length, warm-up and validation."""
    rated = {"strategy": "lrs", "lr_base_batch": B0}
    return {
        "recipe": {"strategy": "lbt"},
        "large": rated,
        "ags": {"strategy": "ags", "ags": {"base": "sgd", "small_batch": B0}},  # factors up to sqrt(8)
        # one factor per kind of parameter against one for all (the default above: one per tensor)
        "ags_group": {"strategy": "ags", "ags": {"base": "sgd", "small_batch": B0, "granularity": "group"}},
        "ags_model": {"strategy": "ags", "ags": {"base": "sgd", "small_batch": B0, "granularity": "model"}},
        "adascale": {"strategy": "adascale", "lr_base_batch": B0},
        "ramp": {**rated, "batch_schedule": "ramp", "ramp": {"start_batch": B0, "fraction": RAMP_SHARE}},
        "adaptive": {**rated, "batch_schedule": "adaptive", "batch_schedule_every": None},
        # the schedule carried by AdaScale's gain, to the recipe's progress (the summary's adaptive_* keys: `adaptive`)
        "adaptive_adascale": {"strategy": "adascale", "lr_base_batch": B0, "batch_schedule": "adaptive"},
        "adaptive_reset": {
            **rated,
            "batch_schedule": "adaptive",
            "batch_schedule_every": None,
            "adam_moments_on_batch_change": "reset",
        },
    }[arm]


def arm_job(arm: str, seed: int, scale: str = "full") -> Job:
    """The example's job with the arm's settings, validated as the workflow validates it. A fixed batch validates
    every fixed number of steps (the same token spacing); a moving one every fixed number of tokens."""
    s, seq_len = SCALES[scale], example()["data"]["seq_len"]
    tokens_per_step = first_batch(arm) * seq_len
    every = s["val_every_tokens"]
    validation = {"val_every_tokens": every} if arm in MOVING else {"val_every_steps": every // tokens_per_step}
    train = {
        "tokens": s["tokens"],
        "lr": LR,
        "lr_base_batch": B0,
        "lr_schedule": {"warmup_steps": max(1, round(WARMUP_SHARE * s["tokens"] / tokens_per_step))},
        "val_samples": s["val_samples"],
        "seed": seed,
        **validation,
    }
    changes = {"train": merged(train, arm_train(arm)), "resources": {"cpus_per_task": 1}}
    if s["train_characters"]:
        changes["data"] = {"kwargs": {"train_characters": s["train_characters"]}}
    if arm in ADAPTIVE:
        changes["objective"] = {"minimize": "goodput"}
    config = validate_config({"launcher": "local", "jobs": {NAME: merged(example(), changes)}})
    return job_settings(config, NAME)


def example() -> dict:
    """The example's one job as written."""
    (job,) = yaml.safe_load(EXAMPLE.read_text())["jobs"].values()
    return job


def gpu_candidates(train_samples: int, scale: str = "full") -> list[dict]:
    """perfmodel.json's candidates at 2 ranks from Pollux's GPU step times (placement GPU_PLACEMENT), at the
    global batches B0 to 8 x B0 by doublings: what the adaptive arms choose among."""
    from tula_hpc.core.run_layout import steps_per_epoch

    with open(TRACE) as handle:
        steps = {
            int(r["local_bsz"]): float(r["step_time"])
            for r in csv.DictReader(handle)
            if r["placement"] == GPU_PLACEMENT
        }
    epochs = SCALES[scale]["tokens"] / (train_samples * example()["data"]["seq_len"])
    rows, batch = [], B0
    while batch <= LARGE:
        per_device = batch // WORLD
        step = traced(steps, per_device * SAMPLES_PER_SEQUENCE)
        per_epoch = steps_per_epoch(train_samples, WORLD, per_device)
        time_s = epochs * per_epoch * step
        rows.append(
            dict(
                nodes=WORLD,
                gpus_per_node=1,
                batch=batch,
                per_device_batch=per_device,
                step_s=step,
                steps_per_epoch=per_epoch,
                warmup_s=0.0,
                epoch_start_s=0.0,
                time_s=time_s,
                cost=WORLD * time_s / 3600,
                rel_uncertainty=0.0,
            )
        )
        batch *= 2
    return rows


def traced(steps: dict[int, float], local: int) -> float:
    """The trace's step at per-GPU batch `local`, linear between its traced batches (32, 45, 64, 91, 129, ...)."""
    below = max(b for b in steps if b <= local)
    above = min(b for b in steps if b >= local)
    if below == above:
        return steps[below]
    return steps[below] + (steps[above] - steps[below]) * (local - below) / (above - below)


def digest_of(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:12]


def validation_curve(summary: dict) -> list[dict]:
    """Every validation of the run in order: step, tokens, validation loss and the global batch then (each record's
    own)."""
    keys = ("step", "tokens", "val_loss", "global_batch")
    return [{key: record[key] for key in keys} for record in summary["history"] if "val_loss" in record]


def to_target(curve: list[dict], target: float) -> dict | None:
    """Steps and tokens at which the validation loss first reaches `target`, linear between the two validations
    around the crossing (the first validation's own where it is already there); None where it never does."""
    for i, point in enumerate(curve):
        if point["val_loss"] <= target:
            if i == 0:
                return {"steps": float(point["step"]), "tokens": float(point["tokens"])}
            before = curve[i - 1]
            share = (before["val_loss"] - target) / (before["val_loss"] - point["val_loss"])
            return {
                "steps": before["step"] + share * (point["step"] - before["step"]),
                "tokens": before["tokens"] + share * (point["tokens"] - before["tokens"]),
            }
    return None


def run_cell(cell: dict, scratch: Path, scale: str, candidates: dict | None) -> dict:
    """One arm at one seed: its validation curve, final validation loss, steps, tokens, time and batch over the run."""
    job = arm_job(cell["arm"], cell["seed"], scale)
    from tula_hpc.performance.batch_schedule import BatchRamp, BatchSchedule

    worker = {}
    if cell["arm"] in ADAPTIVE:
        worker["schedule"] = BatchSchedule(job, tuple(candidates["rows"]), candidates["train_samples"])
    elif cell["arm"] == "ramp":
        worker["schedule"] = BatchRamp.for_run(job, cell["batch"], WORLD)  # as the train stage builds it
    started = time.perf_counter()
    summary = train_cell(job, cell["batch"], scratch / cell["key"], WORLD, NAME, **worker)
    curve = validation_curve(summary)
    record = {
        **cell,
        "curve": curve,
        "final_val_loss": curve[-1]["val_loss"],
        "steps": summary["optimizer_steps"],
        "tokens": summary["tokens"],
        "train_time_s": summary["train_time_s"],
        "batch_changes": [h["batch_schedule"] for h in summary["history"] if "batch_schedule" in h],
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"{cell['arm']:14s} seed {cell['seed']}: final val loss {record['final_val_loss']:.4f}, {record['steps']} "
        f"steps, {record['tokens']} tokens, {record['train_time_s']:.0f} s, batches "
        f"{sorted({p['global_batch'] for p in curve})}",
        flush=True,
    )
    return record


def cell(arm: str, seed: int, scale: str, digest: str, candidates: dict) -> dict:
    code = digest + (candidates["digest"] if arm in ADAPTIVE else "")
    key = cell_key(arm_job(arm, seed, scale), selected_batch(arm), WORLD, code)
    return {"arm": arm, "seed": seed, "batch": selected_batch(arm), "key": key}


def estimate_s(arms: list[str], scale: str) -> float:
    """The whole run's seconds by this machine's timing (SECONDS_PER_KTOKEN; a moving batch at the larger rate)."""
    s = SCALES[scale]
    per_cell = [s["tokens"] / 1000 * SECONDS_PER_KTOKEN[B0 if a == "recipe" else LARGE] + CELL_START_S for a in arms]
    return len(s["seeds"]) * sum(per_cell)


def run(arms: list[str], scratch: Path, scale: str = "full", cells: Path = CELLS) -> dict:
    """Every (seed, arm) cell, seed-major (a partial run covers whole seeds first), cached in `cells`."""
    digest = code_digest()
    train_samples = train_windows(scale)
    rows = gpu_candidates(train_samples, scale)
    candidates = {"rows": rows, "train_samples": train_samples, "digest": digest_of(rows)}
    done = {r["key"]: r for r in (read_jsonl(cells) if cells.exists() else [])}
    planned = [cell(arm, seed, scale, digest, candidates) for seed in SCALES[scale]["seeds"] for arm in arms]
    cached = sum(c["key"] in done for c in planned)
    minutes = estimate_s(arms, scale) / 60
    print(f"{len(planned)} cells ({cached} cached); the whole run about {minutes:.0f} minutes here", flush=True)
    records = []
    for c in planned:
        if c["key"] not in done:
            done[c["key"]] = run_cell(c, scratch, scale, candidates)
            append_jsonl(cells, done[c["key"]])
        records.append(done[c["key"]])
    return figures(records, arms, scale, candidates)


def train_windows(scale: str) -> int:
    """The training split's windows, as the trainer counts them (the adaptive arms' candidates need it)."""
    from tula_hpc.training.datasets import load_splits

    job = arm_job("recipe", 0, scale)
    return len(load_splits(job.data, job.train.seed).train)


def judged(records: list[dict]) -> dict[int, dict[str, dict]]:
    """By seed, then arm: each record with its steps, tokens and wall time to the seed's target (the recipe's final
    validation loss x TARGET_FACTOR; None where the arm never reaches it)."""
    by_seed: dict[int, dict[str, dict]] = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["arm"]] = r
    for arms in by_seed.values():
        target = arms["recipe"]["final_val_loss"] * TARGET_FACTOR if "recipe" in arms else None
        for r in arms.values():
            reached = to_target(r["curve"], target) if target is not None else None
            r["target_loss"] = target
            trained = r["curve"][-1]["tokens"]  # the last validation's, at the run's end: what the steps saw
            r["to_target"] = reached and {**reached, "wall_s": r["train_time_s"] * reached["tokens"] / trained}
    return by_seed


SUMMARY_KEYS = (
    "adaptive_steps_over_recipe",
    "adaptive_steps_over_ramp",
    "adaptive_loss_over_recipe",
    "ags_minus_large_batch_loss",
)


def paired(by_seed: dict[int, dict[str, dict]], figure) -> dict:
    """`figure(arms)` over the seeds where it is defined (not None): mean and 95 % t interval (null bounds from one
    seed); all null, n 0, where no seed defines it."""
    values = [v for arms in by_seed.values() if (v := figure(arms)) is not None]
    if not values:  # e.g. steps to a target no seed's run reached: mean and bounds null
        return {"mean": None, "ci95": [None, None], "n": 0, "seeds": len(by_seed)}
    spread = interval(values)
    return {**spread, "ci95": [None if math.isnan(b) else b for b in spread["ci95"]], "seeds": len(by_seed)}


def ratio(arms: dict, numerator: str, denominator: str, key: str) -> float | None:
    top, bottom = (arms.get(a) and arms[a]["to_target"] for a in (numerator, denominator))
    return top[key] / bottom[key] if top and bottom else None


def loss_of(arms: dict, arm: str) -> float | None:
    return arms[arm]["final_val_loss"] if arm in arms else None


def summarize(by_seed: dict[int, dict[str, dict]]) -> dict:
    def loss_ratio(arms, a, b):
        return None if None in (loss_of(arms, a), loss_of(arms, b)) else loss_of(arms, a) / loss_of(arms, b)

    def loss_difference(arms, a, b):
        return None if None in (loss_of(arms, a), loss_of(arms, b)) else loss_of(arms, a) - loss_of(arms, b)

    return {
        "adaptive_steps_over_recipe": paired(by_seed, lambda a: ratio(a, "adaptive", "recipe", "steps")),
        "adaptive_steps_over_ramp": paired(by_seed, lambda a: ratio(a, "adaptive", "ramp", "steps")),
        "adaptive_loss_over_recipe": paired(by_seed, lambda a: loss_ratio(a, "adaptive", "recipe")),
        "ags_minus_large_batch_loss": paired(by_seed, lambda a: loss_difference(a, "ags", "large")),
        "adaptive_reset_steps_over_adaptive": paired(
            by_seed, lambda a: ratio(a, "adaptive_reset", "adaptive", "steps")
        ),
        "adaptive_reset_minus_adaptive_loss": paired(
            by_seed, lambda a: loss_difference(a, "adaptive_reset", "adaptive")
        ),
        "ramp_steps_over_recipe": paired(by_seed, lambda a: ratio(a, "ramp", "recipe", "steps")),
        "adaptive_adascale_steps_over_recipe": paired(
            by_seed, lambda a: ratio(a, "adaptive_adascale", "recipe", "steps")
        ),
        "adaptive_adascale_loss_over_recipe": paired(by_seed, lambda a: loss_ratio(a, "adaptive_adascale", "recipe")),
        "ags_group_minus_model_loss": paired(by_seed, lambda a: loss_difference(a, "ags_group", "ags_model")),
        "ags_tensor_minus_model_loss": paired(by_seed, lambda a: loss_difference(a, "ags", "ags_model")),
    }


def targets(summary: dict, by_seed: dict[int, dict[str, dict]]) -> dict:
    """The issue's targets: met only where every seed's adaptive run reached the target loss."""
    every = bool(by_seed) and all(a.get("adaptive") and a["adaptive"]["to_target"] for a in by_seed.values())

    def mean_at_most(name: str, bound: float) -> dict:
        figure = summary[name]["mean"]
        return {"met": every and figure is not None and figure <= bound, "figure": figure, "target": bound}

    return {
        "adaptive_steps_at_most_0.7x_recipe": mean_at_most("adaptive_steps_over_recipe", 0.7),
        "adaptive_steps_at_most_ramp": mean_at_most("adaptive_steps_over_ramp", 1.0),
        "adaptive_loss_within_1_percent_of_recipe": mean_at_most("adaptive_loss_over_recipe", TARGET_FACTOR),
        "ags_minus_large_batch_loss": {"reported": summary["ags_minus_large_batch_loss"]},
    }


def per_arm(by_seed: dict[int, dict[str, dict]], arms: list[str]) -> dict:
    """Per arm, means over the seeds: steps, tokens and wall time to the target (over the seeds that reach it),
    the final validation loss, the steps and tokens trained; and the batch at each validation (tokens, batch)."""
    table = {}
    for arm in arms:
        runs = [a[arm] for a in by_seed.values() if arm in a]
        reached = [r["to_target"] for r in runs if r["to_target"]]
        table[arm] = {
            "seeds": len(runs),
            "seeds_reaching_target": len(reached),
            **{
                f"{k}_to_target": statistics.fmean(x[k] for x in reached) if reached else None
                for k in ("steps", "tokens", "wall_s")
            },
            "final_val_loss": statistics.fmean(r["final_val_loss"] for r in runs),
            "steps": statistics.fmean(r["steps"] for r in runs),
            "tokens": statistics.fmean(r["tokens"] for r in runs),
            "train_time_s": statistics.fmean(r["train_time_s"] for r in runs),
            "batch_over_run": [[p["tokens"], p["global_batch"]] for p in runs[0]["curve"]],  # the first seed's
        }
    return table


def figures(records: list[dict], arms: list[str], scale: str, candidates: dict) -> dict:
    by_seed = judged(records)
    figures_ = summarize(by_seed)
    summary = {key: figures_[key] for key in SUMMARY_KEYS}  # the four, in its order
    return {
        "summary": summary,
        "comparisons": {key: value for key, value in figures_.items() if key not in SUMMARY_KEYS},
        "targets": targets(figures_, by_seed),
        "arms": per_arm(by_seed, arms),
        "settings": settings(arms, scale, candidates),
        "provenance": provenance(),
        "cells": records,
    }


def settings(arms: list[str], scale: str, candidates: dict) -> dict:
    return {
        "scale": scale,
        **SCALES[scale],
        "example": EXAMPLE.relative_to(REPO).as_posix(),
        "world_size": WORLD,
        "b0": B0,
        "large_batch": LARGE,
        "lr_at_b0": LR,
        "warmup_share_of_tokens": WARMUP_SHARE,
        "ramp_share_of_tokens": RAMP_SHARE,
        "target": f"the recipe's final validation loss x {TARGET_FACTOR}, per seed",
        "arms": {arm: arm_train(arm) for arm in arms},
        "gpu_step_model": {
            "trace": TRACE.relative_to(REPO).as_posix(),
            "placement": GPU_PLACEMENT,
            "samples_per_sequence": SAMPLES_PER_SEQUENCE,
            "candidates": candidates["rows"],
            "digest": candidates["digest"],
        },
        "job_of_recipe_seed_0": arm_job("recipe", 0, scale).as_dict(),
    }


def plot(records: list[dict], out: Path) -> None:
    """The batch over tokens and the validation loss over tokens, per arm, at the first seed (the report's style)."""
    from tula_hpc.reporting.figures import plt, save_png

    seed = min(r["seed"] for r in records)
    fig, (batches, losses) = plt.subplots(1, 2, figsize=(11, 4))
    for r in (r for r in records if r["seed"] == seed):
        tokens = [0] + [p["tokens"] for p in r["curve"]]
        ran = [first_batch(r["arm"])] + [p["global_batch"] for p in r["curve"]]
        batches.step(tokens, ran, where="pre", label=r["arm"])
        losses.plot(tokens[1:], [p["val_loss"] for p in r["curve"]], marker=".", label=r["arm"])
    if (target := next((r.get("target_loss") for r in records if r["seed"] == seed), None)) is not None:
        losses.axhline(target, color="grey", linestyle=":", label="target")
    batches.set(xlabel="training tokens", ylabel="global batch (sequences)", yscale="log", title=f"batch (seed {seed})")
    losses.set(xlabel="training tokens", ylabel="validation loss (nats/char)", title="validation loss")
    losses.legend(fontsize=8)
    save_png(fig, out)


def report(result: dict) -> None:
    for arm, a in result["arms"].items():
        steps = "-" if a["steps_to_target"] is None else f"{a['steps_to_target']:.0f}"
        wall = "-" if a["wall_s_to_target"] is None else f"{a['wall_s_to_target']:.0f} s"
        print(
            f"{arm:14s} to target: {steps} steps, {wall} ({a['seeds_reaching_target']}/{a['seeds']} seeds); "
            f"final val loss {a['final_val_loss']:.4f}"
        )
    for name, figure in {**result["summary"], **result["comparisons"]}.items():
        if figure["mean"] is not None:
            lo, hi = figure["ci95"]
            bounds = "" if lo is None else f" [{lo:.3f}, {hi:.3f}]"
            print(f"{name}: {figure['mean']:.3f}{bounds} over {figure['n']} seeds")
    for name, verdict in result["targets"].items():
        if "met" in verdict:
            print(f"{name}: {verdict['figure']} (target {verdict['target']}): {'met' if verdict['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "lm_large_batch.json")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run (default all)")
    parser.add_argument("--scratch", type=Path, help="folder for the runs (default: a temporary one)")
    parser.add_argument(
        "--smoke", action="store_true", help="every arm at a tiny scale, its cells in a temporary folder"
    )
    args = parse_bench_args(parser, argv)
    arms = [arm for arm in ARMS if arm in args.arms]
    if args.smoke:
        scratch = smoke_scratch("lm-large-batch")
        result = run(arms, scratch, "smoke", scratch / "cells.jsonl")
    else:
        result = run(arms, args.scratch or Path(tempfile.mkdtemp(prefix="lm-large-batch-")))
    print("settings:", json.dumps({k: v for k, v in result["settings"].items() if k != "job_of_recipe_seed_0"}))
    write_json(args.out, result)
    plot(result["cells"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}", flush=True)
    report(result)
    return 0
