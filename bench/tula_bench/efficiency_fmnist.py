"""The Fashion-MNIST half of bench/statistical_efficiency.py (issue 26): AdaScale and the goodput choice against the
small-batch reference, in Table I's regime (bench/generalization_fmnist.py, scale cpu: 14x14 images, 6 epochs at
B=128 with decays at epochs 4 and 5, two gloo ranks of one core, test accuracy after precise BN).

- reference: lbt at B=128 for the recipe's 6 epochs (Table I's small-batch reference);
- adascale: train.strategy adascale at B = 1024, 2048 and 4096, trained until the recipe's progress (AdaScale's
  gain is measured, not set: it has no free setting for the tuning seeds to choose, and its base recipe is the
  reference's, lr 0.05 at lr_base_batch 128);
- goodput: the DAG itself (snakemake --profile profiles/local, up to selection.json) chooses the batch for the
  recipe with objective.minimize goodput and train.strategy adascale on a tuning seed, over batches 32 to 4096 on
  this machine's 2 ranks (search.nodes 2 to 2); the chosen batch is then trained on the test seeds as the train
  stage would train it (adascale, to the recipe's progress).
Every cell runs on the 5 test seeds, which choose nothing. Differences from the reference are paired over the seeds
(a seed fixes the split, the initial weights and the data order) with 95 % t intervals. Wall time is the train
stage's training time (train_time_s; the DAG's measuring phase, spent once per job, is reported beside it).
Cells are cached in bench/results/statistical_efficiency_cells.jsonl under generalization_fmnist's key (every
training setting and the training code's digest), so a stopped run continues and a code change reruns them.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tula_bench.common import (
    JOBS_FILE,
    REPO,
    RESULTS,
    bench_config,
    files_digest,
    merged,
    train_cell,
    trained_scores,
)
from tula_bench.generalization_fmnist import SCALES, SMALL_BATCH, cell_job, cell_key, code_digest, interval
from tula_hpc.core.atomic_files import append_jsonl, read_json, read_jsonl

SCALE = "cpu"
MODELS = ("bn_cnn",)  # Table I's first architecture; cifar_resnet's cells take several times as long here
WORLD = 2
TUNING_SEED = 100
CELLS = RESULTS / "statistical_efficiency_cells.jsonl"
ACCURACY_MARGIN = 0.5  # points: the "within 0.5 points of the B=128 reference"
CHOICE_JOB = "bench-goodput-fmnist"
# What the DAG's choice depends on: the whole workflow, its package, profiles and the jobs file it merges into.
DAG_CODE = ["tula_hpc", "workflow", "Snakefile", "profiles", "config"]
SUMMARY = ("goodput_accuracy_minus_reference", "goodput_time_over_reference", "adascale_worst_accuracy_minus_reference")
# What the goodput job measures besides its 2 ranks, per generalization_fmnist scale: cpu's batches 32 to 4096;
# smoke's (a bench's --smoke) the least the DAG accepts: two batches, the fewest steps, one attempt (no measuring
# again on this busy machine), no confirming profiles, the memory probes in the stage's own process.
MEASURING = {
    "cpu": {"search": {"batch": {"min": 32, "max": 4096}}},
    "smoke": {
        "search": {
            "batch": {"min": 32, "max": 64},
            "warmup_steps": 0,
            "steps": 2,
            "min_measure_s": 0,
            "max_attempts": 1,
            "confirm": 0,
        },
        "resources": {"memory_probes_in": "one_process"},
    },
}


def goodput_changes(model: str, scale: str = SCALE) -> dict:
    """The goodput job: the reference cell's job (the recipe) with adascale, the goodput objective and the search
    over this machine's 2 ranks."""
    recipe = cell_job(scale, model, "adascale", TUNING_SEED, None).as_dict()
    changes = {
        "model": recipe["model"],
        "data": recipe["data"],
        "train": recipe["train"],
        "resources": {k: recipe["resources"][k] for k in ("gpus_per_node", "cpus_per_task")},
        "search": {"nodes": {"min": WORLD, "max": WORLD}},
        "objective": {"minimize": "goodput"},
    }
    return merged(changes, MEASURING[scale])


def choice_digest(model: str, scale: str = SCALE) -> str:
    """What a cached choice of the DAG is reused under: its code and the goodput job's settings."""
    return files_digest(DAG_CODE, goodput_changes(model, scale))


def choose_by_goodput(model: str, folder: Path, scale: str = SCALE) -> dict:
    """The DAG's own choice for the goodput job (snakemake to results/<job>/selection.json) and its measuring time."""
    changes = goodput_changes(model, scale)
    bench_config(as_name=CHOICE_JOB, **changes)  # a bad setting fails here, naming the field
    folder.mkdir(parents=True, exist_ok=True)
    override = folder / "goodput.yaml"
    override.write_text(yaml.safe_dump({"targets": [CHOICE_JOB], "jobs": {CHOICE_JOB: changes}}))
    target = f"results/{CHOICE_JOB}/selection.json"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(folder), target]
    cmd += ["--profile", str(REPO / "profiles" / "local"), "--configfile", str(JOBS_FILE), str(override)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    started = time.perf_counter()
    with open(folder / "snakemake.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    selection = read_json(folder / target)
    chosen = selection["chosen"]
    noise = read_json(folder / f"results/{CHOICE_JOB}/perfmodel.json").get("noise_scale")
    return {
        "phase": "choice",
        "model": model,
        "batch": chosen["batch"],
        "nodes": chosen["nodes"],
        "predicted": selection["predicted"],
        "progress_steps": chosen.get("progress_steps"),
        "noise_scale": noise,
        "measuring_wall_s": time.perf_counter() - started,
        "changes": changes,
    }


def plan(choices: dict[str, dict]) -> list[dict]:
    """The test cells, seed-major: reference, adascale at each large batch, and the goodput choice once made."""
    digest, cells = code_digest(), []
    for seed in SCALES[SCALE]["test_seeds"]:
        for model in MODELS:
            runs = [("reference", "lbt", SMALL_BATCH)]
            runs += [("adascale", "adascale", b) for b in SCALES[SCALE]["large_batches"]]
            if model in choices:
                runs.append(("goodput", "adascale", choices[model]["batch"]))
            for kind, strategy, batch in runs:
                key = cell_key(cell_job(SCALE, model, strategy, seed, None), batch, WORLD, digest)
                cells.append(dict(kind=kind, model=model, strategy=strategy, batch=batch, seed=seed, key=key))
    return cells


def run_cell(cell: dict, scratch: Path) -> dict:
    job = cell_job(SCALE, cell["model"], cell["strategy"], cell["seed"], None)
    run_dir = scratch / cell["key"]
    started = time.perf_counter()
    summary = train_cell(job, cell["batch"], run_dir, WORLD, "bench-statistical-efficiency")
    record = {
        **cell,
        "phase": "test",
        **trained_scores(job, run_dir / "model.pt"),
        **{k: summary[k] for k in ("epochs", "steps", "steps_per_epoch", "train_time_s")},
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"{cell['kind']:9s} {cell['model']} B={cell['batch']:5d} seed {cell['seed']}: "
        f"test {record['test_accuracy']:.4f} in {record['epochs']} epochs, {record['steps']} steps, "
        f"{record['train_time_s']:.0f} s",
        flush=True,
    )
    return record


def run(scratch: Path, deadline: float | None = None) -> dict:
    """Choose by goodput, train every planned cell not yet in CELLS (none started after `deadline`), and the
    figures."""
    records = read_jsonl(CELLS) if CELLS.exists() else []
    digests = {model: choice_digest(model) for model in MODELS}  # each hashes the whole workflow: once a model
    choices = {
        r["model"]: r for r in records if r["phase"] == "choice" and r.get("code_digest") == digests.get(r["model"])
    }
    for model in MODELS:
        if model not in choices:
            choices[model] = {**choose_by_goodput(model, scratch / f"dag-{model}"), "code_digest": digests[model]}
            append_jsonl(CELLS, choices[model])
    done = {r["key"]: r for r in records if r["phase"] == "test"}
    for cell in plan(choices):
        if cell["key"] in done or (deadline is not None and time.perf_counter() > deadline):
            continue
        done[cell["key"]] = run_cell(cell, scratch)
        append_jsonl(CELLS, done[cell["key"]])
    return figures(plan(choices), done, choices)


def _row(records: list[dict], reference: list[dict] | None) -> dict:
    accuracy = [100 * r["test_accuracy"] for r in records]
    row = {
        "seeds": [r["seed"] for r in records],
        "test_accuracy_mean": statistics.fmean(accuracy),
        "test_accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
        "epochs_median": statistics.median(r["epochs"] for r in records),
        "steps_median": statistics.median(r["steps"] for r in records),
        "train_time_s_median": statistics.median(r["train_time_s"] for r in records),
    }
    if reference:
        by_seed = {r["seed"]: r for r in reference}
        paired = [r for r in records if r["seed"] in by_seed]
        if paired:
            row["minus_reference"] = interval(
                [100 * (r["test_accuracy"] - by_seed[r["seed"]]["test_accuracy"]) for r in paired]
            )
            row["time_over_reference"] = statistics.median(
                r["train_time_s"] / by_seed[r["seed"]]["train_time_s"] for r in paired
            )
            row["steps_over_reference"] = statistics.median(r["steps"] / by_seed[r["seed"]]["steps"] for r in paired)
    return row


def figures(cells: list[dict], done: dict[str, dict], choices: dict[str, dict]) -> dict:
    """Per model: the reference, AdaScale per batch and the goodput choice, each against the reference; the
    summary's three figures (None where a cell has not run)."""
    tables, worst, goodput = {}, None, None
    for model in MODELS:
        ran = [done[c["key"]] | {"kind": c["kind"]} for c in cells if c["model"] == model and c["key"] in done]
        reference = [r for r in ran if r["kind"] == "reference"]
        table = {"reference": _row(reference, None) if reference else None, "adascale": {}}
        for batch in SCALES[SCALE]["large_batches"]:
            cell = [r for r in ran if r["kind"] == "adascale" and r["batch"] == batch]
            if cell:
                table["adascale"][str(batch)] = row = _row(cell, reference)
                if "minus_reference" in row and (worst is None or row["minus_reference"]["mean"] < worst["mean"]):
                    worst = {"model": model, "batch": batch, **row["minus_reference"]}
        chosen = [r for r in ran if r["kind"] == "goodput"]
        if chosen:
            table["goodput"] = goodput = {**_row(chosen, reference), "choice": choices[model]}
        tables[model] = table
    planned = len(cells)
    return {
        "goodput_accuracy_minus_reference": None if goodput is None else goodput.get("minus_reference"),
        "goodput_time_over_reference": None if goodput is None else goodput.get("time_over_reference"),
        "adascale_worst_accuracy_minus_reference": worst,
        "tables": tables,
        "cells_planned": planned,
        "cells_done": sum(c["key"] in done for c in cells),
        "complete": all(c["key"] in done for c in cells),
        "settings": {
            "scale": SCALE,
            "models": list(MODELS),
            "regime": {k: SCALES[SCALE][k] for k in ("image_size", "epochs", "large_batches", "test_seeds")},
            "world_size": WORLD,
            "small_batch": SMALL_BATCH,
            "tuning_seed_of_the_goodput_choice": TUNING_SEED,
            "accuracy_margin_points": ACCURACY_MARGIN,
            "example_job": cell_job(SCALE, MODELS[0], "adascale", 0, None).as_dict(),
        },
    }


def met(fmnist: dict) -> dict:
    """The issue's Fashion-MNIST targets, each as met or not with its figure."""
    goodput, worst = fmnist["goodput_accuracy_minus_reference"], fmnist["adascale_worst_accuracy_minus_reference"]
    adascale_rows = [row for t in fmnist["tables"].values() for row in t["adascale"].values()]
    return {
        "goodput_accuracy_within_margin": {
            "met": bool(goodput is not None and goodput["ci95"][0] >= -ACCURACY_MARGIN),  # a numpy bool otherwise
            "figure": goodput,
            "target": f"95 % interval above -{ACCURACY_MARGIN} points",
        },
        "goodput_less_wall_time": {
            "met": (fmnist["goodput_time_over_reference"] or float("inf")) < 1,
            "figure": fmnist["goodput_time_over_reference"],
            "target": "< 1",
        },
        "adascale_within_margin_every_cell": {
            "met": bool(adascale_rows) and worst is not None and worst["mean"] >= -ACCURACY_MARGIN,
            "figure": worst,
            "target": f"mean difference >= -{ACCURACY_MARGIN} points in every cell",
        },
        "adascale_fewer_steps_every_cell": {
            "met": bool(adascale_rows) and all(row.get("steps_over_reference", 1) < 1 for row in adascale_rows),
            "figure": [row.get("steps_over_reference") for row in adascale_rows],
            "target": "< 1 in every cell",
        },
    }
