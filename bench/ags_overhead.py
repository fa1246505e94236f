"""What AGS costs on top of the plain optimiser at the same batch (target: <= 3 % per epoch).

Per model (the default job's tiny CNN on 8x8 digits, mobilenet_v3_small on 32x32), global batch 256,
one process with 2 threads, SGD with momentum as in the default job, and per granularity:
- plain_step_s / ags_step_s: median optimiser step (zero_grad, forward, backward, step). AGS runs with
  delta = inf, so every step pays the gate (one squared norm) and the scaling (the worst case);
- update_s: median update_gradscale, one forward/backward of the 32-sample reference batch, once per
  epoch by default;
- overhead_per_epoch: (steps x (ags_step - plain_step) + update) / (steps x plain_step) for the digits
  epoch (5 steps of 256) and a CIFAR-10-sized epoch (45000 images: 176 steps);
- measured_epoch: a whole digits-sized epoch through the real strategy hooks (tula_hpc.strategies,
  lbt vs ags: profiling, gate, scaling, the epoch's metrics and histogram), measured directly.
Plain and AGS alternate step by step (epoch by epoch for measured_epoch), so drift on the shared
machine hits both; figures are medians. Writes bench/results/ags_overhead.json. Run it under `flock /tmp/tula-cpu.lock`.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tula_hpc.ags import TulaOptimizer  # noqa: E402
from tula_hpc.config import job_settings, load_config  # noqa: E402
from tula_hpc.files import write_json  # noqa: E402
from tula_hpc.models import build_model  # noqa: E402
from tula_hpc.strategies import build_strategy  # noqa: E402

BATCH = 256
SMALL = 32
# model -> (image size, repeats): a 20 ms tiny-CNN step needs many more samples than a 0.5 s one to
# see through the noise of a shared machine.
MODELS = {"tiny_cnn": (8, 8), "mobilenet_v3_small": (32, 1)}
EPOCHS = {"digits (1257 images)": math.ceil(1257 / BATCH), "cifar10-sized (45000 images)": math.ceil(45000 / BATCH)}
GRANULARITIES = ("element", "tensor")
TARGET = 0.03
OUT = REPO / "bench" / "results" / "ags_overhead.json"


def timed(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def sgd(model: torch.nn.Module, train_cfg: dict) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=train_cfg["lr"], momentum=train_cfg["momentum"],
                           weight_decay=train_cfg["weight_decay"])


def measure_model(name: str, train_cfg: dict, rounds: int, steps: int) -> dict:
    size, repeats = MODELS[name]
    rounds, steps = rounds * repeats, steps * repeats
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 1, size, size), torch.randint(0, 10, (BATCH,))
    base = build_model(name, 10, 1, size)
    plain_model = copy.deepcopy(base)
    plain = sgd(plain_model, train_cfg)
    runs = {}
    for granularity in GRANULARITIES:
        model = copy.deepcopy(base)
        opt = TulaOptimizer(sgd(model, train_cfg), delta=math.inf, large_batch_size=BATCH, small_batch_size=SMALL,
                            granularity=granularity)
        runs[granularity] = (model, opt)

    def step(model, opt):
        def run():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return run

    def update(model, opt):
        def run():
            opt.update_gradscale(model, F.cross_entropy, x, y)
        return run

    for model, opt in runs.values():  # factors in place, so that scaled steps multiply
        step(model, opt)()
        update(model, opt)()
    # Step by step in turn (plain, element, tensor, ...), so drift on the shared machine hits all alike.
    contenders = {"plain": (plain_model, plain), **runs}
    samples = {key: [] for key in [*contenders, *(f"update_{g}" for g in GRANULARITIES)]}
    for _ in range(rounds):
        for model, opt in contenders.values():
            timed(step(model, opt), 1)  # warm-up
        for _ in range(steps):
            for key, (model, opt) in contenders.items():
                samples[key] += timed(step(model, opt), 1)
        for granularity, (model, opt) in runs.items():
            samples[f"update_{granularity}"] += timed(update(model, opt), 1)
    plain_s = statistics.median(samples["plain"])
    result = {"plain_step_s": plain_s, "ags_step_s": {}, "update_s": {}, "per_step_overhead": {}, "overhead_per_epoch": {}}
    for granularity in GRANULARITIES:
        ags_s = statistics.median(samples[granularity])
        update_s = statistics.median(samples[f"update_{granularity}"])
        result["ags_step_s"][granularity] = ags_s
        result["update_s"][granularity] = update_s
        result["per_step_overhead"][granularity] = (ags_s - plain_s) / plain_s
        result["overhead_per_epoch"][granularity] = {
            label: (n * (ags_s - plain_s) + update_s) / (n * plain_s) for label, n in EPOCHS.items()}
    result["measured_epoch"] = measure_epochs(name, base, x, y, train_cfg, rounds)
    return result


def measure_epochs(name: str, base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train_cfg: dict,
                   rounds: int) -> dict:
    """Digits-sized epochs through the strategy hooks, as train.py runs them (a sensitive step is not scaled)."""
    steps = EPOCHS["digits (1257 images)"]
    strategies = {}
    for name_ in ("lbt", "ags"):
        model = copy.deepcopy(base)
        strategies[name_] = (model, build_strategy(model, {**train_cfg, "strategy": name_}, BATCH, steps))

    def epoch(model, strategy):
        def run():
            for _ in range(steps):
                strategy.optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                strategy.before_step(model, F.cross_entropy, x, y)
                strategy.optimizer.step()
                strategy.after_step()
            strategy.end_epoch()
        return run

    for model, strategy in strategies.values():
        epoch(model, strategy)()  # warm-up, and the first AGS epoch has no factors yet
    samples = {k: [] for k in strategies}
    for _ in range(rounds):
        for key, (model, strategy) in strategies.items():
            samples[key] += timed(epoch(model, strategy), 1)
    lbt, ags = statistics.median(samples["lbt"]), statistics.median(samples["ags"])
    return {"steps": steps, "lbt_epoch_s": lbt, "ags_epoch_s": ags, "overhead": (ags - lbt) / lbt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and optimiser (interleaved)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_cfg = job_settings(load_config([REPO / "config" / "jobs.yaml"]), "digits-cnn")["train"]
    models = {}
    for name in MODELS:
        models[name] = measure_model(name, train_cfg, args.rounds, args.steps)
        r = models[name]
        print(f"{name}: plain step {r['plain_step_s'] * 1e3:.2f} ms", flush=True)
        for g in GRANULARITIES:
            epochs = ", ".join(f"{label} {100 * v:+.2f} %" for label, v in r["overhead_per_epoch"][g].items())
            print(f"  {g:8s} ags step {r['ags_step_s'][g] * 1e3:.2f} ms ({100 * r['per_step_overhead'][g]:+.2f} %), "
                  f"update {r['update_s'][g] * 1e3:.2f} ms; per epoch: {epochs}")
        m = r["measured_epoch"]
        print(f"  measured digits epoch ({m['steps']} steps): lbt {m['lbt_epoch_s'] * 1e3:.1f} ms, "
              f"ags {m['ags_epoch_s'] * 1e3:.1f} ms ({100 * m['overhead']:+.2f} %)", flush=True)
    result = {
        "setup": {"batch": BATCH, "small_batch": SMALL, "threads": 2, "processes": 1, "rounds": args.rounds,
                  "steps_per_round": args.steps, "repeats (rounds and steps x)": {m: r for m, (_, r) in MODELS.items()},
                  "optimizer": "SGD momentum 0.9, weight decay 5e-4",
                  "ags_step": "delta = inf: every step gated and scaled (worst case)", "epochs": EPOCHS},
        "target_overhead_per_epoch": TARGET,
        "models": models,
        "meets_target": {name: {g: {label: v <= TARGET for label, v in r["overhead_per_epoch"][g].items()}
                                for g in GRANULARITIES} for name, r in models.items()},
    }
    write_json(OUT, result)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
