"""Benchmark: how well the performance model predicts step time from partial, adaptive and full profiles.

For each model the whole grid available here (N in {1, 2} ranks as local processes, per-device batch b
from 8 to 512) is measured in up to ROUNDS rounds (at least MIN_ROUNDS, none that would end after
BUDGET_S) with the profile stage's own measurement (`profiling.measure`: same model, loader, DDP,
retries when other work disturbs it). Each round runs in a shuffled order that mixes models and
configurations, inside one pair of long-lived ranks (no process start per configuration).

Each round then plays the role of one profiling campaign, judged against the other rounds:
- truth(c): median step time of configuration c over the OTHER rounds (a fit never meets its own data),
  of those the profiler saw undisturbed by other work when there are any;
- noise_floor: median of |x_r(c) / truth(c) - 1| over configurations and rounds: how far one careful
  measurement lands from the others. A model error below it cannot be shown;
- partial / adaptive: fit on the round's profiles the mode chooses, error on every configuration it did
  not profile; full: leave-one-out over the grid;
- profiling_cost_s: node-seconds the mode's profiles took (ranks x measurement wall time, warm-up,
  retries and back-off included; the per-job launch overhead of real profile jobs is not counted);
- selection_regret: measured time of the configuration each mode picks for the `time` objective over
  the measured best, minus 1 (cost_regret likewise for node-hour cost).

On the local Slurm cluster (`--launcher slurm`, after `make slurm-up`) the pool is one 2-node sbatch job:
the ranks talk over the cluster's network, and, as on any cluster, the model knows each rank alone on
its node (ranks_per_host 1), so partial search profiles 3 configurations instead of 4.

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/perf_accuracy.py [--launcher slurm]
      .venv/bin/python bench/perf_accuracy.py --reuse bench/results/perf_accuracy.json   (re-analyse only)
Writes bench/results/perf_accuracy[_slurm].json (figures and the raw per-round measurements).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "perf_accuracy.json"
MODELS = {"tiny_cnn": 8, "resnet18": 8, "mobilenet_v3_small": 16}  # model -> image side (digits, resized)
NODES = (1, 2)
PER_DEVICE = (8, 512)
ROUNDS = 5  # at most; at least MIN_ROUNDS, and no round that would end after BUDGET_S
MIN_ROUNDS = 3
BUDGET_S = 900.0
MEASUREMENT = {"warmup_steps": 2, "steps": 4, "min_measure_s": 1.0, "max_attempts": 3, "interference_tolerance": 0.1}
# Adaptive search stops on predictions confirmed within this; here it is set to about this machine's noise
# floor (a tighter tolerance cannot be confirmed on it and turns adaptive into full search).
ADAPTIVE = {"tolerance": 0.10, "max_profiles": None}
TARGETS = {"partial_median": 0.05, "full_median": 0.02, "regret": 0.03, "partial_cost_share": 0.25}


def bench_jobs(launcher: str) -> dict[str, dict]:
    from tula_hpc.config import job_settings, load_config

    config = load_config([REPO / "config" / "jobs.yaml"])
    jobs = {}
    for model, side in MODELS.items():
        job = job_settings(config, next(iter(config["jobs"])))
        job["name"] = f"bench-{model}"
        job["model"]["name"] = model
        job["data"].update(name="digits", image_size=side)
        job["search"].update(
            MEASUREMENT,
            adaptive=ADAPTIVE,
            nodes={"min": NODES[0], "max": NODES[-1]},
            batch={"min": PER_DEVICE[0], "max": NODES[-1] * PER_DEVICE[1]},
        )
        job["launcher"] = launcher
        jobs[model] = job
    return jobs


def grid(job: dict, train_samples: int) -> list[dict]:
    from tula_hpc.plan import candidate_grid

    return [
        c
        for c in candidate_grid(job["search"], 1, PER_DEVICE[1], train_samples)
        if c["per_device_batch"] >= PER_DEVICE[0]
    ]


def pool_worker(jobs: dict, rounds: list[list[dict]], budget_s: float) -> list[dict] | None:
    """Both ranks walk the rounds; one-rank configurations run on rank 0 while rank 1 waits (idle).

    After MIN_ROUNDS, another round starts only if it should end within `budget_s`: on a busy machine
    re-measured disturbances make rounds slow, and the benchmark must still finish in time.
    """
    import torch
    import torch.distributed as dist

    from tula_hpc.distributed import Context, init_distributed, shutdown
    from tula_hpc.plan import ranks_per_host
    from tula_hpc.profiling import measure

    ctx = init_distributed(False)
    alone = Context(0, 1, 0, torch.device("cpu"))
    started = time.perf_counter()
    records = []
    for done, schedule in enumerate(rounds):
        elapsed = time.perf_counter() - started
        go_on = torch.tensor([float(done < MIN_ROUNDS or elapsed / done * (done + 1) <= budget_s)])
        dist.broadcast(go_on, src=0)  # rank 0's clock decides for both
        if not go_on.item():
            break
        for item in schedule:
            job = jobs[item["model"]]
            record = None
            if item["nodes"] == ctx.world_size:
                record = measure(job, ctx, item["per_device_batch"])
            elif ctx.rank == 0:
                record = measure(job, alone, item["per_device_batch"])
            dist.barrier()
            if ctx.rank == 0:
                record.pop("per_step")
                hosts = ranks_per_host(job["launcher"], record["world_size"], 1)
                records.append({**item, **record, "ranks_per_host": hosts})
                print(
                    f"round {item['round']} {item['model']} N={item['nodes']} b={item['per_device_batch']}: "
                    f"{record['median']['step_s'] * 1e3:.2f} ms (interference {record['interference']:.2f})",
                    flush=True,
                )
    shutdown()
    return records if ctx.rank == 0 else None


def measure_all(jobs: dict, grids: dict, rounds: int, seed: int, budget_s: float, launcher: str) -> list[dict]:
    from tula_hpc import launch

    rng = random.Random(seed)
    schedule = []
    for r in range(rounds):
        order = [{"round": r, "model": m, **c} for m, g in grids.items() for c in g]
        rng.shuffle(order)
        schedule.append(order)
    os.environ.setdefault("TULA_COLLECTIVE_TIMEOUT_S", "3600")  # a rank may wait out a long one-rank measurement
    spec = launch.LaunchSpec(launcher=launcher, nodes=NODES[-1], cpus_per_task=1, time_min=60)
    work = REPO / "work" / "bench" / f"perf_accuracy_{launcher}"
    return launch.run(
        pool_worker, dict(jobs=jobs, rounds=schedule, budget_s=budget_s), spec, work, name="bench-perf-accuracy"
    )


def _key(c: dict) -> tuple[int, int]:
    return c["nodes"], c["batch"]


def disturbed(record: dict) -> bool:
    return record["interference"] > MEASUREMENT["interference_tolerance"]


def _rel(predicted: float, measured: float) -> float:
    return float(abs(predicted / measured - 1))


def evaluate_model(job: dict, candidates: list[dict], records: list[dict], train_samples: int) -> dict:
    from tula_hpc.perfmodel import (
        adaptive_search,
        estimate_steps,
        fit_profiles,
        leave_one_out,
        measured_steps,
        measurement_weight,
        model_params,
        steps_per_epoch,
    )
    from tula_hpc.plan import partial_set, ranks_per_host

    launcher = job["launcher"]

    def rows(configs: list[dict]) -> list[list[int]]:
        return [[c["nodes"], c["per_device_batch"], ranks_per_host(launcher, c["nodes"], 1)] for c in configs]

    rounds = sorted({r["round"] for r in records})
    by_round = {r: {_key(x): x for x in records if x["round"] == r} for r in rounds}
    settings = model_params(job)
    search = job["search"]

    def truth(c, excluded):
        """Median over the other rounds, of their quiet measurements when there are any."""
        others = [by_round[r][_key(c)] for r in rounds if r != excluded]
        quiet = [x for x in others if not disturbed(x)] or others
        return statistics.median(x["median"]["step_s"] for x in quiet)

    def total(c, step):  # training time up to the constant number of epochs
        return steps_per_epoch(train_samples, c["nodes"], c["per_device_batch"]) * step

    def regrets(profiles: list[dict], r) -> tuple[float, float]:
        """As selection sees it: a profiled candidate's measured step weighed in (perfmodel.estimate_steps)."""
        model = fit_profiles(profiles, **settings)
        weight = measurement_weight(leave_one_out(profiles, **settings), search["noise_prior"])
        steps = estimate_steps(model, rows(candidates), measured_steps(profiles), weight)
        predicted = [total(c, s) for c, s in zip(candidates, steps)]
        measured = [total(c, truth(c, r)) for c in candidates]
        fastest = int(np.argmin(predicted))
        cheapest = int(np.argmin([t * c["nodes"] for t, c in zip(predicted, candidates)]))
        measured_cost = [t * c["nodes"] for t, c in zip(measured, candidates)]
        return float(measured[fastest] / min(measured) - 1), float(measured_cost[cheapest] / min(measured_cost) - 1)

    def cost(used, r) -> float:
        return sum(by_round[r][_key(c)]["measure_wall_s"] * c["nodes"] for c in used)

    modes: dict[str, dict] = {
        m: {"errors": [], "costs": [], "regret": [], "cost_regret": [], "profiled": []}
        for m in ("partial", "adaptive", "full")
    }
    for current in rounds:
        profiles = by_round[current]
        measure = lambda c, profiles=profiles: profiles[_key(c)]  # noqa: E731  (the round's measurement stands in for a profile job)
        chosen = {"partial": partial_set(candidates, 1, launcher)}
        adaptive = adaptive_search(
            candidates,
            chosen["partial"],
            measure,
            lambda c: (c["nodes"], ranks_per_host(launcher, c["nodes"], 1)),
            settings,
            search["adaptive"]["tolerance"],
            search["adaptive"]["max_profiles"],
        )
        chosen["adaptive"] = adaptive["profiled"]
        for mode in ("partial", "adaptive"):
            model = fit_profiles([measure(c) for c in chosen[mode]], **settings)
            unseen = [c for c in candidates if c not in chosen[mode]]
            modes[mode]["errors"] += [_rel(p, truth(c, current)) for c, p in zip(unseen, model.predict(rows(unseen)))]
        for held in candidates:
            rest = [measure(c) for c in candidates if c is not held]
            model = fit_profiles(rest, **settings)
            step = model.predict(rows([held]))[0]
            modes["full"]["errors"].append(_rel(step, truth(held, current)))
        chosen["full"] = candidates
        for mode, used in chosen.items():
            time_regret, cost_regret = regrets([measure(c) for c in used], current)
            modes[mode]["regret"].append(time_regret)
            modes[mode]["cost_regret"].append(cost_regret)
            modes[mode]["costs"].append(cost(used, current))
            modes[mode]["profiled"].append(len(used))

    deviation = {
        (r, _key(c)): _rel(by_round[r][_key(c)]["median"]["step_s"], truth(c, r)) for r in rounds for c in candidates
    }
    noise = list(deviation.values())
    quiet = [e for (r, k), e in deviation.items() if not disturbed(by_round[r][k])]
    loud = [e for (r, k), e in deviation.items() if disturbed(by_round[r][k])]
    full_cost = statistics.median(modes["full"]["costs"])
    summary = {}
    for mode, m in modes.items():
        summary[mode] = {  # adaptive search that ended up profiling everything leaves nothing unseen to judge
            "median_rel_error": statistics.median(m["errors"]) if m["errors"] else None,
            "max_rel_error": max(m["errors"]) if m["errors"] else None,
            "profiled_configs": statistics.median(m["profiled"]),
            "profiling_cost_s": statistics.median(m["costs"]),
            "profiling_cost_share_of_full": statistics.median(m["costs"]) / full_cost,
            "selection_regret": statistics.median(m["regret"]),
            "selection_regret_max": max(m["regret"]),
            "cost_regret": statistics.median(m["cost_regret"]),
        }
    noise_floor = statistics.median(noise)
    for mode in summary.values():
        mode["error_over_noise_floor"] = (
            mode["median_rel_error"] / noise_floor if mode["median_rel_error"] is not None else None
        )
    return {
        "noise_floor": noise_floor,
        "noise_max": max(noise),
        "configs": len(candidates),
        "rounds": len(rounds),
        # How far measurements the profiler saw as quiet, and those it saw disturbed, land from the truth.
        "noise_quiet": statistics.median(quiet) if quiet else None,
        "noise_disturbed": statistics.median(loud) if loud else None,
        "disturbed": len(loud),
        "modes": summary,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", type=Path, help="re-analyse the measurements stored in an earlier result file")
    parser.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="slurm: the pool is one job on the local Slurm cluster (make slurm-up first)",
    )
    parser.add_argument(
        "--out", type=Path, help=f"default {OUT.name}, or perf_accuracy_slurm.json with --launcher slurm"
    )
    args = parser.parse_args()

    import json

    from tula_hpc.data import load_splits
    from tula_hpc.files import write_json

    reused = json.loads(args.reuse.read_text()) if args.reuse else None
    launcher = reused["settings"].get("launcher", "local") if reused else args.launcher
    out = args.out or (OUT if launcher == "local" else OUT.with_name(f"perf_accuracy_{launcher}.json"))
    jobs = bench_jobs(launcher)
    train_samples = len(load_splits(next(iter(jobs.values()))["data"], 0).train)
    grids = {m: grid(job, train_samples) for m, job in jobs.items()}
    started = time.time()
    if reused:
        records, measure_wall = reused["measurements"], reused.get("measure_wall_s")
    else:
        records = measure_all(jobs, grids, args.rounds, args.seed, BUDGET_S, launcher)
        measure_wall = time.time() - started
    results = {
        m: evaluate_model(jobs[m], grids[m], [r for r in records if r["model"] == m], train_samples) for m in jobs
    }

    def across_models(mode: str, key: str) -> float | None:
        values = [results[m]["modes"][mode][key] for m in results if results[m]["modes"][mode][key] is not None]
        return statistics.median(values) if values else None

    overall = {
        mode: {
            key: across_models(mode, key)
            for key in ("median_rel_error", "max_rel_error", "profiling_cost_share_of_full", "selection_regret")
        }
        for mode in ("partial", "adaptive", "full")
    }
    noise_floor = statistics.median(r["noise_floor"] for r in results.values())
    met = {
        "partial_median": bool(overall["partial"]["median_rel_error"] <= TARGETS["partial_median"]),
        "full_median": bool(overall["full"]["median_rel_error"] <= TARGETS["full_median"]),
        "regret": bool(max(overall[m]["selection_regret"] for m in overall) <= TARGETS["regret"]),
        "partial_cost_share": bool(overall["partial"]["profiling_cost_share_of_full"] <= TARGETS["partial_cost_share"]),
    }
    report = {
        "description": "step-time prediction error on configurations not used in the fit (full: leave-one-out), per "
        "search mode; medians over models of per-model figures",
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "median_interference": statistics.median(r.get("interference", 0.0) for r in records),
            "disturbed_share": sum(map(disturbed, records)) / len(records),
        },
        "settings": {
            "launcher": launcher,
            "models": MODELS,
            "nodes": NODES,
            "per_device_batch": PER_DEVICE,
            "rounds": len({r["round"] for r in records}),
            "max_rounds": args.rounds,
            "budget_s": BUDGET_S,
            "measurement": MEASUREMENT,
            "adaptive": ADAPTIVE,
        },
        "targets": TARGETS,
        "targets_met": met,
        "noise_floor": noise_floor,
        "overall": overall,
        "models": results,
        "measure_wall_s": measure_wall,
        "reanalysed": bool(args.reuse),
        "measurements": records,
    }
    write_json(out, report)
    print(
        f"noise floor (median relative spread of repeated measurements): {noise_floor:.1%}; "
        f"{report['machine']['disturbed_share']:.0%} of the measurements stayed disturbed by other work"
    )
    for m, r in results.items():
        disturbed_noise = "-" if r["noise_disturbed"] is None else f"{r['noise_disturbed']:.1%}"
        print(
            f"{m}: noise floor {r['noise_floor']:.1%} (quiet measurements {r['noise_quiet']:.1%}, "
            f"{r['disturbed']} disturbed ones {disturbed_noise})"
        )
        for mode, s in r["modes"].items():
            if s["median_rel_error"] is None:
                print(f"  {mode:8s} profiled every configuration in every round: nothing left to judge")
                continue
            print(
                f"  {mode:8s} median {s['median_rel_error']:6.1%} max {s['max_rel_error']:6.1%} "
                f"({s['error_over_noise_floor']:.1f}x noise)  profiled {s['profiled_configs']:4.1f}  "
                f"cost {s['profiling_cost_s']:6.1f} node-s ({s['profiling_cost_share_of_full']:.0%} of full)  "
                f"regret {s['selection_regret']:.1%}"
            )
    for mode, s in overall.items():
        print(
            f"overall {mode:8s} "
            + " ".join(f"{key} {'-' if value is None else f'{value:.1%}'}" for key, value in s.items())
        )
    print("targets met:", met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
