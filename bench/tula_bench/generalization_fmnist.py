"""Large-batch generalisation on Fashion-MNIST: the paper's Table I (AGS against LBT, LRS, LARS and PoLo), measured
with choices made on validation data and tuning seeds, and test accuracy reported over other seeds.

Regime. Fashion-MNIST's 60,000 training images less a seeded validation split of 6,000, standard augmentation
(a random crop after padding), the 10,000 test images; a small-batch reference (lbt at B=128) and three large
global batches with at least 7 steps per epoch at the largest (4096: 13); every strategy at one epoch budget;
2 DDP ranks. Two architectures: bn_cnn (two conv-BatchNorm blocks) and cifar_resnet (He et al.'s CIFAR ResNet
from torchvision's BasicBlock).

Settings each strategy's authors recommend, scaled to the epoch budget: the learning rate decays by 10 at 2/3
and 5/6 of training (the default job's fractions); lrs and lars scale it linearly from B=128 and warm up over
WARMUP_SHARE of training (Goyal et al.: 5 of 90 epochs; the paper: 5 epochs of its runs); polo averages
models 4 times an epoch after its synchronous phase, which ends at the first decay (Lin et al.'s post-local SGD
switches there); static uses the paper's s = 2.

Protocol. The free settings (AGS's granularity, delta and the recipe it scales, train.ags.base; LARS's trust
coefficient, 0.001 as in You et al. and timm, 0.02 as in apex's LARC) are chosen per model by mean validation
accuracy (after precise BN) over the tuning seeds at the tuning batch; the test seeds, which choose nothing, give
the reported test accuracies. Per cell: mean, std, steps per epoch and updates in all; AGS against LBT and against
the best baseline per cell as paired differences over the test seeds (a seed fixes the split, the initial weights
and the data order for every strategy alike) with 95 % t intervals. If the chosen AGS is not the paper's
(element-wise factors, delta 0.5), the paper's AGS is reported beside it.

Cells are cached in bench/results/generalization_fmnist_cells[-SCALE].jsonl under a key of every setting training
and scoring depend on and a digest of the code training runs (TRAINING_CODE): a rerun after a change recomputes
the cells the change touched and reuses the rest; a stopped bench continues where it stopped. Run it under
`flock /tmp/tula-cpu.lock`. `--scale gpu` (`make gpu-generalization`) runs the same protocol at 28x28 with
torchvision's resnet18, more epochs and more seeds, in bf16, one rank per GPU (two when there are two).
`--minutes M` starts no cell after M minutes, so that a time-limited call (a device call, an allocation) ends with
its cells written; `--cells-at-once K` runs K cells side by side where the machine has room for them. `--smoke` runs
the first cell of the smoke scale (digits at 8x8, one epoch, a narrow bn_cnn) in a fresh temporary folder, its cells
file there too: the continuous-integration check that the bench runs end to end.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path

from scipy import stats

from tula_bench.common import (
    RESULTS,
    WORK,
    bench_job,
    bench_parser,
    files_digest,
    parse_bench_args,
    smoke_scratch,
    stage_code,
    train_cell,
    trained_scores,
    write_result,
)
from tula_hpc.core.atomic_files import append_jsonl, read_jsonl
from tula_hpc.core.dependencies import stage_settings
from tula_hpc.core.job import Job

STRATEGIES = ("lbt", "lrs", "lars", "polo", "static", "ags")
BASELINES = ("lbt", "lrs", "lars", "polo")  # the paper's Table I
SMALL_BATCH = 128
WARMUP_SHARE = 1 / 6
PAPER_AGS = "element, delta 0.5 (paper)"  # Algorithm 1: one factor per gradient entry
# The free settings, chosen on validation: one entry per variant, merged into train.<strategy section>. AGS: the
# paper's, two others on plain SGD (tensor at delta 0.5 validated last of four at both models and was dropped), and
# AGS on top of lrs and lars (train.ags.base: their optimiser, scaled rate and warm-up), which the issue allows.
TUNED = {
    "ags": {
        PAPER_AGS: {"granularity": "element", "delta": 0.5},
        "element, delta 0.2": {"granularity": "element", "delta": 0.2},
        "tensor, delta 0.2": {"granularity": "tensor", "delta": 0.2},
        "on lrs, tensor, delta 0.2": {"base": "lrs", "granularity": "tensor", "delta": 0.2},
        "on lars, element, delta 0.5": {"base": "lars", "granularity": "element", "delta": 0.5},
        "on lars, tensor, delta 0.5": {"base": "lars", "granularity": "tensor", "delta": 0.5},
    },
    "lars": {"trust 0.001": {"trust_coefficient": 0.001}, "trust 0.02": {"trust_coefficient": 0.02}},
}
SCALES = {
    "cpu": {
        "data_set": "fashion_mnist",
        "image_size": 14,
        "epochs": 6,
        "models": {"bn_cnn": {"width": 16}, "cifar_resnet": {"width": 8, "blocks": 1}},
        "large_batches": [1024, 2048, 4096],
        "tuning_batch": 2048,
        "tuning_seeds": [100, 101],
        "test_seeds": [0, 1, 2, 3, 4],
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "precision": "fp32",
        "cells_at_once": 1,  # 2 ranks of one core each take both cores here
    },
    # Twice the epochs, a sixth test seed, bf16 autocast. One rank: NCCL gives a GPU to one rank alone. 296 cells
    # of 12 epochs, more than one 30-minute device session holds: --minutes ends a call in time, its cells file
    # comes back and is committed, and the next session continues from it. Cells one at a time: the residual
    # network at B=4096 may take half an 80 GB card, and a cell that ran out of memory beside another would
    # relaunch at a smaller per-device batch, a different BatchNorm batch.
    "gpu": {
        "data_set": "fashion_mnist",
        "image_size": 28,
        "epochs": 12,
        "models": {"bn_cnn": {"width": 32}, "torchvision.models:resnet18": {}},
        "large_batches": [1024, 2048, 4096],
        "tuning_batch": 2048,
        "tuning_seeds": [100, 101],
        "test_seeds": [0, 1, 2, 3, 4, 5],
        "gpus_per_node": 1,
        "cpus_per_task": 4,  # 3 loader workers: the GPU waits on the per-image augmentation otherwise
        "precision": "bf16",
        "cells_at_once": 1,
    },
    # --smoke's: the cpu scale's shape at its smallest, on digits (seconds a cell); never a --scale of its own, so its
    # cells never enter the results' caches.
    "smoke": {
        "data_set": "digits",
        "image_size": 8,
        "epochs": 2,  # one would end lrs's warm-up with training, which the config refuses
        "models": {"bn_cnn": {"width": 4}},
        "large_batches": [256],
        "tuning_batch": 256,
        "tuning_seeds": [100],
        "test_seeds": [0],
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "precision": "fp32",
        "cells_at_once": 1,
    },
}
# What a cell's result depends on besides its settings: the train and evaluate stages and all they can import (the
# training loop, its strategies, data, models, the batch schedule's choice, scoring).
TRAINING_CODE = stage_code("train", "evaluate")


def code_digest() -> str:
    return files_digest(TRAINING_CODE)


def world_size(scale: dict) -> int:
    """2 DDP ranks: CPU processes here; on GPUs one rank per GPU (NCCL cannot give two ranks one GPU)."""
    if not scale["gpus_per_node"]:
        return 2
    import torch

    return max(1, min(2, torch.cuda.device_count()))


@functools.cache
def cell_job(scale_name: str, model: str, strategy: str, seed: int, variant: str | None) -> Job:
    """The validated job of one cell: the variant's settings merged into the strategy's section of train (validated
    once: a Job is frozen, so every caller may share it)."""
    scale, settings = SCALES[scale_name], TUNED[strategy][variant] if variant else {}
    epochs = scale["epochs"]
    decays = [round(epochs * 2 / 3), round(epochs * 5 / 6)]
    section = {"ags": "ags", "static": "ags", "lars": "lars"}.get(strategy)
    return bench_job(
        as_name="bench-generalization-fmnist",
        model={"name": model, "kwargs": scale["models"][model]},
        data={"name": scale["data_set"], "root": None, "image_size": scale["image_size"], "augment": "standard"},
        train={
            "epochs": epochs,
            "precision": scale["precision"],
            "strategy": strategy,
            "seed": seed,
            "lr_milestones": decays,
            "warmup_epochs": max(1, round(epochs * WARMUP_SHARE)),
            "polo": {"sync_epochs": decays[0], "averages_per_epoch": 4},
            **({section: settings} if section else {}),
        },
        resources={name: scale[name] for name in ("gpus_per_node", "cpus_per_task")},
    )


def cell_key(job: Job, batch: int, world: int, digest: str) -> str:
    """The cache key of a cell: what its scores depend on (the train stage's settings, the processes they run on,
    the batch) and the training code's digest; other settings (search, objective) do not
    enter, so a change there reuses every cell."""
    settings = {
        **stage_settings(job.as_dict(), "train"),  # model, data, train: all the evaluate stage's scores depend on too
        **{f"resources.{name}": getattr(job.resources, name) for name in ("gpus_per_node", "cpus_per_task")},
    }
    return hashlib.sha256(json.dumps([settings, batch, world, digest], sort_keys=True).encode()).hexdigest()[:20]


def plan(scale_name: str, chosen: dict[str, dict[str, str]] | None, digest: str) -> list[dict]:
    """The cells to run: the tuning cells, then (once `chosen` holds each model's choice) the test cells,
    seed-major, so that a partial run already covers every cell of a seed."""
    scale, cells = SCALES[scale_name], []

    def add(phase: str, model: str, batch: int, strategy: str, seed: int, variant: str | None) -> None:
        key = cell_key(cell_job(scale_name, model, strategy, seed, variant), batch, world_size(scale), digest)
        cells.append(
            dict(phase=phase, model=model, batch=batch, strategy=strategy, seed=seed, variant=variant, key=key)
        )

    for seed in scale["tuning_seeds"]:
        for model in scale["models"]:
            for strategy, variants in TUNED.items():
                for variant in variants:
                    add("tuning", model, scale["tuning_batch"], strategy, seed, variant)
    if chosen is None:
        return cells
    for seed in scale["test_seeds"]:
        for model in scale["models"]:
            add("test", model, SMALL_BATCH, "lbt", seed, None)
            for batch in scale["large_batches"]:
                for strategy in STRATEGIES:
                    add("test", model, batch, strategy, seed, chosen[model].get(strategy))
                if chosen[model]["ags"] != PAPER_AGS:
                    add("test", model, batch, "ags", seed, PAPER_AGS)
    return cells


def choose(records: list[dict], scale: dict) -> dict[str, dict[str, str]] | None:
    """Each model's variant of every tuned strategy with the best mean validation accuracy over the tuning seeds;
    None until every tuning cell has run."""
    tuning = [r for r in records if r["phase"] == "tuning"]
    wanted = len(scale["tuning_seeds"]) * len(scale["models"]) * sum(map(len, TUNED.values()))
    if len(tuning) < wanted:
        return None
    chosen: dict[str, dict[str, str]] = {}
    for model in scale["models"]:
        for strategy, variants in TUNED.items():
            val = {
                v: [r["val_accuracy_precise_bn"] for r in tuning if (r["model"], r["variant"]) == (model, v)]
                for v in variants
            }
            chosen.setdefault(model, {})[strategy] = max(variants, key=lambda v: statistics.fmean(val[v]))
    return chosen


def run_cell(cell: dict, scale_name: str, scratch: Path) -> dict:
    job = cell_job(scale_name, cell["model"], cell["strategy"], cell["seed"], cell["variant"])
    run_dir = scratch / cell["key"]
    started = time.perf_counter()
    summary = train_cell(job, cell["batch"], run_dir, world_size(SCALES[scale_name]), "bench-generalization-fmnist")
    record = {
        **cell,
        **trained_scores(job, run_dir / "model.pt"),
        "steps": summary["steps"],
        "steps_per_epoch": summary["steps_per_epoch"],
        "train_time_s": summary["train_time_s"],
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"{cell['phase']:6s} {cell['model']:28s} B={cell['batch']:5d} {cell['strategy']:6s} seed {cell['seed']:3d} "
        f"{cell['variant'] or '':28s} val {record['val_accuracy_precise_bn']:.4f} test {record['test_accuracy']:.4f} "
        f"({record['wall_s']:.0f} s)",
        flush=True,
    )
    return record


def planned_cells(cells_path: Path, scale_name: str, digest: str) -> tuple[list[dict], dict | None, list[dict]]:
    """The records in `cells_path`, the choices its tuning cells made (None before the last is in), the plan."""
    records = read_jsonl(cells_path) if cells_path.exists() else []
    tuning_keys = {c["key"] for c in plan(scale_name, None, digest)}
    chosen = choose([r for r in records if r["key"] in tuning_keys], SCALES[scale_name])
    return records, chosen, plan(scale_name, chosen, digest)


def run_cells(
    pool: Executor,
    workers: int,
    cells_path: Path,
    scale_name: str,
    scratch: Path,
    *,
    max_cells: int | None = None,
    deadline: float | None = None,
    run=run_cell,
) -> int:
    """Run the planned cells not yet in `cells_path`, `workers` at once on `pool`, appending each record as it
    finishes; the test cells are planned once the last tuning cell is in. No cell starts after `deadline`
    (time.perf_counter()) or beyond `max_cells`; the cells running then finish. Returns how many ran."""
    digest = code_digest()
    running: dict[Future, str] = {}
    started = ran = 0
    while True:
        records, chosen, cells = planned_cells(cells_path, scale_name, digest)
        done = {r["key"] for r in records} | set(running.values())
        todo = [c for c in cells if c["key"] not in done]
        if started == 0:
            print(f"{len(cells)} cells planned, {len(todo)} to run; choices: {chosen}", flush=True)
        while (
            todo
            and len(running) < workers
            and (max_cells is None or started < max_cells)
            and (deadline is None or time.perf_counter() < deadline)
        ):
            cell = todo.pop(0)
            running[pool.submit(run, cell, scale_name, scratch)] = cell["key"]
            started += 1
        if not running:
            return ran
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in finished:
            del running[future]
            append_jsonl(cells_path, future.result())
            ran += 1


def interval(differences: list[float]) -> dict:
    """Mean of paired differences (points) with its 95 % t interval."""
    n = len(differences)
    mean = statistics.fmean(differences)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(differences) / n**0.5 if n > 1 else float("nan")
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def test_runs(records: list[dict]) -> dict[tuple, dict[int, dict]]:
    """The test cells' records by (model, batch, strategy, variant), then by seed."""
    runs: dict[tuple, dict[int, dict]] = {}
    for r in records:
        if r["phase"] == "test":
            runs.setdefault((r["model"], r["batch"], r["strategy"], r["variant"]), {})[r["seed"]] = r
    return runs


def table(records: list[dict], scale: dict, chosen: dict) -> dict:
    """Per model and batch: every strategy's test accuracy over the test seeds, and AGS's paired differences."""
    by_cell = test_runs(records)

    def runs(model, batch, strategy, variant) -> dict[int, dict]:
        return by_cell.get((model, batch, strategy, variant), {})

    def cell(by_seed: dict[int, dict]) -> dict:
        values = [100 * r["test_accuracy"] for r in by_seed.values()]
        any_run = next(iter(by_seed.values()))
        return {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values),
            "steps_per_epoch": any_run["steps_per_epoch"],
            "updates": any_run["steps"],
            "values": values,
        }

    def paired(a: dict[int, dict], b: dict[int, dict]) -> dict | None:
        seeds = sorted(set(a) & set(b))
        return interval([100 * (a[s]["test_accuracy"] - b[s]["test_accuracy"]) for s in seeds]) if seeds else None

    out: dict = {}
    for model in scale["models"]:
        ref = runs(model, SMALL_BATCH, "lbt", None)
        per_batch = {"small_batch_reference": cell(ref)} if ref else {}
        for batch in scale["large_batches"]:
            by_strategy = {s: runs(model, batch, s, chosen[model].get(s)) for s in STRATEGIES}
            row = {s: cell(r) for s, r in by_strategy.items() if r}
            entry: dict = {"strategies": row}
            if by_strategy["ags"] and all(by_strategy[s] for s in BASELINES):
                best = max(BASELINES, key=lambda s: row[s]["mean"])
                entry.update(
                    best_baseline=best,
                    ags_minus_lbt=paired(by_strategy["ags"], by_strategy["lbt"]),
                    ags_minus_best=paired(by_strategy["ags"], by_strategy[best]),
                )
            paper = runs(model, batch, "ags", PAPER_AGS)
            if paper and chosen[model]["ags"] != PAPER_AGS:
                entry["paper_ags"] = cell(paper)
                entry["paper_ags_minus_lbt"] = paired(paper, by_strategy["lbt"])
            per_batch[str(batch)] = entry
        out[model] = per_batch
    return out


def headline(result: dict, records: list[dict], scale: dict, chosen: dict) -> dict:
    """ags_minus_lbt_mean_points averaged over models and large batches, with a 95 % interval over the test seeds
    (each seed's average over the cells), and the worst AGS-minus-best-baseline cell."""
    by_cell = test_runs(records)
    pairs = [
        [by_cell.get((model, batch, s, chosen[model].get(s)), {}) for s in ("ags", "lbt")]
        for model in scale["models"]
        for batch in scale["large_batches"]
    ]
    per_seed = [
        statistics.fmean(100 * (ags[seed]["test_accuracy"] - lbt[seed]["test_accuracy"]) for ags, lbt in pairs)
        for seed in scale["test_seeds"]
        if all(seed in ags and seed in lbt for ags, lbt in pairs)
    ]
    versus_best = [
        (model, batch, entry["ags_minus_best"])
        for model, rows in result.items()
        for batch, entry in rows.items()
        if isinstance(entry, dict) and entry.get("ags_minus_best")
    ]
    worst = min(versus_best, key=lambda item: item[2]["mean"], default=None)
    mean_vs_lbt = interval(per_seed) if per_seed else None
    return {
        "ags_minus_lbt_mean_points": mean_vs_lbt,
        "worst_ags_minus_best_baseline": {"model": worst[0], "batch": worst[1], **worst[2]} if worst else None,
        "targets": {
            "ags_minus_lbt_mean_points >= 3": None if mean_vs_lbt is None else mean_vs_lbt["mean"] >= 3,
            "ags within 1 point of the best baseline in every large-batch cell": None
            if worst is None
            else worst[2]["mean"] >= -1,
        },
    }


def cells_file(args: argparse.Namespace, default_out: Path) -> Path:
    """Where this run's cells are cached (and --out for a scale other than cpu left at its default). --smoke: one
    cell of the smoke scale, the cells and their runs in a fresh temporary folder, so bench/results stays as it was
    and the cell is trained, not found in a cache."""
    if args.smoke:
        args.scale, args.max_cells = "smoke", 1
        args.scratch = smoke_scratch("generalization-fmnist")
        return args.scratch / "cells.jsonl"
    suffix = "" if args.scale == "cpu" else f"-{args.scale}"
    if args.scale != "cpu" and args.out == default_out:
        args.out = RESULTS / f"generalization_fmnist{suffix}.json"
    return RESULTS / f"generalization_fmnist_cells{suffix}.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, "generalization_fmnist.json")
    parser.add_argument("--scale", choices=[name for name in SCALES if name != "smoke"], default="cpu")
    parser.add_argument("--max-cells", type=int, default=None, help="start no more than this many cells")
    parser.add_argument("--minutes", type=float, default=None, help="start no cell after this many minutes")
    parser.add_argument("--cells-at-once", type=int, default=None, help="cells run side by side (default: the scale's)")
    parser.add_argument("--scratch", type=Path, default=WORK / "generalization_fmnist", help="the cells' runs")
    parser.add_argument("--smoke", action="store_true", help="one cell of the smoke scale in a temporary folder")
    args = parse_bench_args(parser, argv)
    cells_path = cells_file(args, parser.get_default("out"))
    scale = SCALES[args.scale]
    digest, started = code_digest(), time.perf_counter()
    deadline = started + 60 * args.minutes if args.minutes is not None else None
    workers = args.cells_at_once or scale["cells_at_once"]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:  # a fork can't use CUDA
        ran = run_cells(
            pool, workers, cells_path, args.scale, args.scratch, max_cells=args.max_cells, deadline=deadline
        )
    records, chosen, cells = planned_cells(cells_path, args.scale, digest)
    planned = {c["key"] for c in cells}
    current = [r for r in records if r["key"] in planned]
    figures: dict = {"choices": chosen, "cells_planned": len(cells), "cells_done": len(current)}
    if chosen is not None:
        result = table(current, scale, chosen)
        figures.update(table=result, **headline(result, current, scale, chosen))
    figures.update(cells=current, wall_time_s=time.perf_counter() - started, cells_run_now=ran)
    settings = {
        "scale": args.scale,
        "smoke": args.smoke,
        **scale,
        "world_size": world_size(scale),
        "small_batch": SMALL_BATCH,
        "strategies": list(STRATEGIES),
        "baselines": list(BASELINES),
        "tuned": TUNED,
        "warmup_share": WARMUP_SHARE,
        "code_digest": digest,
        "training_code": TRAINING_CODE,
        "score": "test accuracy after precise BN (BatchNorm statistics recomputed on 8192 training samples)",
        "example_job": cell_job(args.scale, next(iter(scale["models"])), "ags", 0, None).as_dict(),
    }
    write_result(args.out, settings, figures)
    print(json.dumps({k: figures.get(k) for k in ("choices", "ags_minus_lbt_mean_points", "targets")}, indent=1))
