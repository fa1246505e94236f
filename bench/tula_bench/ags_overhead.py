"""What AGS costs on top of the plain optimiser at the same batch (target: <= 3 % per epoch, measured directly).

Per model (the default job's tiny CNN on 8x8 digits, mobilenet_v3_small on 32x32), global batch 256,
one process with 2 threads, SGD with momentum as in the default job, every step through
`train.training_step` and the strategy hooks exactly as training runs them, per granularity:
- plain_step_s / ags_step_s: median step (zero_grad, forward, backward, step) of lbt and of ags with
  delta = inf, so every step pays the gate (one squared norm) and the scaling (the worst case);
- update_s: what an update adds to a step: the step that carries the reference sub-batch as its first
  micro-batch (no extra forward/backward: the sub-batch's gradient is read off before the rest of the
  batch adds to it) plus closing the epoch's metrics, minus an ags step; once per epoch by default;
- separate_update_s: `TulaOptimizer.update_gradscale`, the stand-alone API's separate forward/backward
  of the 32-sample sub-batch (the paper's way), for comparison;
- overhead_per_epoch: (steps x (ags_step - plain_step) + update) / (steps x plain_step) for the digits
  epoch (5 steps of 256) and a CIFAR-10-sized epoch (45000 images: 176 steps), derived from the medians
  above: it explains where time goes but is not judged (it sums medians of separately timed pieces);
- measured_epoch: whole digits-sized epochs of lbt and ags (default delta), measured directly, with a second
  lbt model timed alongside as the noise floor. The target is judged on this overhead.
All contenders alternate step by step (epoch by epoch for measured_epoch), so drift on the shared
machine hits them alike; figures are medians. Writes bench/results/ags_overhead.json (about 8 minutes on
2 threads). Run it under `flock /tmp/tula-cpu.lock`. `--reuse` re-judges the stored measurements without
measuring. `--smoke` measures the tiny CNN alone, one round of one step without repeats (a few seconds: the
continuous-integration check that the bench runs end to end; its figures are noise).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import time

import torch

from tula_bench.common import REPO, bench_parser, parse_bench_args, provenance
from tula_hpc.config import job_settings, load_config
from tula_hpc.core.atomic_files import read_json, write_json
from tula_hpc.core.job import TrainSettings
from tula_hpc.training.models import build_model
from tula_hpc.training.step import training_step
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import ImageClassification

IMAGES = ImageClassification()

BATCH = 256
SMALL = 32
# model -> (image size, repeats): a 20 ms tiny-CNN step needs many more samples than a 0.5 s one to
# see through the noise of a shared machine.
MODELS = {"tiny_cnn": (8, 8), "mobilenet_v3_small": (32, 1)}
EPOCHS = {"digits (1257 images)": math.ceil(1257 / BATCH), "cifar10-sized (45000 images)": math.ceil(45000 / BATCH)}
GRANULARITIES = ("element", "tensor")
TARGET = 0.03
SMOKE_MODELS = {"tiny_cnn": (8, 1)}  # --smoke: the cheap model, no repeats


def timed(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def strategy_for(model: torch.nn.Module, train_cfg: TrainSettings, steps: int, **ags):
    cfg = dataclasses.replace(
        train_cfg, strategy="ags" if ags else "lbt", ags=dataclasses.replace(train_cfg.ags, **ags)
    )
    return build_strategy(model, cfg, BATCH, steps)


def measure_model(name: str, train_cfg: TrainSettings, rounds: int, steps: int, models: dict = MODELS) -> dict:
    size, repeats = models[name]
    rounds, steps = rounds * repeats, steps * repeats
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 1, size, size), torch.randint(0, 10, (BATCH,))
    base = build_model(name, {"num_classes": 10, "in_channels": 1, "image_size": size})
    plain = copy.deepcopy(base)
    contenders = {"plain": (plain, strategy_for(plain, train_cfg, EPOCHS["digits (1257 images)"]))}
    for granularity in GRANULARITIES:
        for role in ("", "update_"):
            model = copy.deepcopy(base)
            contenders[role + granularity] = (
                model,
                strategy_for(model, train_cfg, EPOCHS["digits (1257 images)"], delta=math.inf, granularity=granularity),
            )

    def step(key):
        model, strategy = contenders[key]
        if key.startswith("update_"):

            def run():  # closing an epoch makes the next step carry the reference sub-batch
                strategy.end_epoch()
                training_step(model, strategy, IMAGES, [x, y])

            return run
        return lambda: training_step(model, strategy, IMAGES, [x, y])

    def separate_update(granularity):
        model, strategy = contenders[granularity]
        return lambda: strategy.optimizer.update_gradscale(model, IMAGES.loss_of, [x, y])

    for key in contenders:  # factors in place, so that scaled steps multiply
        contenders[key][1].end_epoch()
        step(key)()
    samples = {key: [] for key in [*contenders, *(f"separate_{g}" for g in GRANULARITIES)]}
    for _ in range(rounds):
        for key in contenders:
            timed(step(key), 1)  # warm-up
        for _ in range(steps):
            for key in contenders:
                samples[key] += timed(step(key), 1)
        for granularity in GRANULARITIES:
            samples[f"separate_{granularity}"] += timed(separate_update(granularity), 1)
    plain_s = statistics.median(samples["plain"])
    result = {
        "plain_step_s": plain_s,
        "ags_step_s": {},
        "update_s": {},
        "separate_update_s": {},
        "per_step_overhead": {},
        "overhead_per_epoch": {},
    }
    for granularity in GRANULARITIES:
        ags_s = statistics.median(samples[granularity])
        update_s = max(0.0, statistics.median(samples[f"update_{granularity}"]) - ags_s)
        result["ags_step_s"][granularity] = ags_s
        result["update_s"][granularity] = update_s
        result["separate_update_s"][granularity] = statistics.median(samples[f"separate_{granularity}"])
        result["per_step_overhead"][granularity] = (ags_s - plain_s) / plain_s
        result["overhead_per_epoch"][granularity] = {
            label: (n * (ags_s - plain_s) + update_s) / (n * plain_s) for label, n in EPOCHS.items()
        }
    result["measured_epoch"] = measure_epochs(base, x, y, train_cfg, rounds)
    return result


def measure_epochs(
    base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train_cfg: TrainSettings, rounds: int
) -> dict:
    """Digits-sized epochs through training_step and the strategy hooks (a sensitive step is not scaled).

    A second lbt model, timed in the same rotation, gives the noise floor: what the same work differs by here.
    """
    steps = EPOCHS["digits (1257 images)"]
    strategies = {}
    for key, name in (("lbt", "lbt"), ("lbt_again", "lbt"), ("ags", "ags")):
        model = copy.deepcopy(base)
        strategies[key] = (model, build_strategy(model, dataclasses.replace(train_cfg, strategy=name), BATCH, steps))

    def epoch(model, strategy):
        def run():
            for _ in range(steps):
                training_step(model, strategy, IMAGES, [x, y])
            strategy.end_epoch()

        return run

    for model, strategy in strategies.values():
        epoch(model, strategy)()  # warm-up, and the first AGS epoch has no factors yet
    samples = {k: [] for k in strategies}
    for _ in range(rounds):
        for key, (model, strategy) in strategies.items():
            samples[key] += timed(epoch(model, strategy), 1)
    lbt, ags = statistics.median(samples["lbt"]), statistics.median(samples["ags"])
    noise = abs(statistics.median(samples["lbt_again"]) - lbt) / lbt
    return {"steps": steps, "lbt_epoch_s": lbt, "ags_epoch_s": ags, "overhead": (ags - lbt) / lbt, "noise_floor": noise}


def judge(result: dict) -> dict:
    """Met or not per model, on the directly measured epoch; the derived per-epoch figures are reported beside it."""
    verdicts = {}
    for name, r in result["models"].items():
        measured = r["measured_epoch"]
        derived = {g: r["overhead_per_epoch"][g]["digits (1257 images)"] for g in r["overhead_per_epoch"]}
        verdicts[name] = {
            "measured_epoch_overhead": measured["overhead"],
            "noise_floor": measured.get("noise_floor"),  # absent from measurements taken before it was timed
            "derived_digits_epoch_overhead (not judged)": derived,
            "met": measured["overhead"] <= result["target_overhead_per_epoch"],
        }
    return verdicts


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(2)
    train_cfg = job_settings(load_config([REPO / "config" / "jobs.yaml"]), "digits-cnn").train
    sizes = SMOKE_MODELS if args.smoke else MODELS
    models = {name: measure_model(name, train_cfg, args.rounds, args.steps, sizes) for name in sizes}
    return {
        "provenance": provenance(),
        "setup": {
            "smoke": args.smoke,
            "batch": BATCH,
            "small_batch": SMALL,
            "threads": 2,
            "processes": 1,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "repeats (rounds and steps x)": {m: r for m, (_, r) in sizes.items()},
            "optimizer": "SGD momentum 0.9, weight decay 5e-4",
            "update": "reference sub-batch fused into the step",
            "ags_step": "delta = inf: every step gated and scaled (worst case)",
            "epochs": EPOCHS,
        },
        "target_overhead_per_epoch": TARGET,
        "models": models,
    }


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, "ags_overhead.json")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and optimiser (interleaved)")
    parser.add_argument("--reuse", action="store_true", help="re-judge the measurements stored in --out")
    parser.add_argument("--smoke", action="store_true", help="the smallest case: tiny_cnn, 1 round of 1 step")
    args = parse_bench_args(parser, argv)
    if args.smoke:
        args.rounds, args.steps = 1, 1
    result = read_json(args.out) if args.reuse else measure(args)
    result["judged_on"] = (
        "measured_epoch.overhead: whole digits-sized epochs of lbt and ags timed directly; "
        "overhead_per_epoch is derived from step medians and only explains where the time goes"
    )
    result["meets_target"] = judge(result)
    if args.reuse:
        result["rejudged"] = (
            "without measuring (--reuse): provenance.git_commit (setup.commit in files written before it) names the "
            "code measured; absent means unknown"
        )
    for name, r in result["models"].items():
        print(f"{name}: plain step {r['plain_step_s'] * 1e3:.2f} ms", flush=True)
        for g in GRANULARITIES:
            epochs = ", ".join(f"{label} {100 * v:+.2f} %" for label, v in r["overhead_per_epoch"][g].items())
            print(
                f"  {g:8s} ags step {r['ags_step_s'][g] * 1e3:.2f} ms ({100 * r['per_step_overhead'][g]:+.2f} %), "
                f"update {r['update_s'][g] * 1e3:.2f} ms (separate pass {r['separate_update_s'][g] * 1e3:.2f} ms); "
                f"derived per epoch: {epochs}"
            )
        m, verdict = r["measured_epoch"], result["meets_target"][name]
        noise = "not measured" if verdict["noise_floor"] is None else f"{100 * verdict['noise_floor']:.2f} %"
        print(
            f"  measured digits epoch ({m['steps']} steps): lbt {m['lbt_epoch_s'] * 1e3:.1f} ms, "
            f"ags {m['ags_epoch_s'] * 1e3:.1f} ms ({100 * m['overhead']:+.2f} %, noise floor {noise}): "
            f"target {100 * result['target_overhead_per_epoch']:.0f} % {'met' if verdict['met'] else 'NOT met'}",
            flush=True,
        )
    write_json(args.out, result)
    print(f"wrote {args.out}")
