"""Benchmark: how well the performance model predicts step time from partial, adaptive and full profiles, and
what the select stage's choice on those predictions costs.

Models and data: tiny_cnn and resnet18 on the default job's digits (1,258 training images), bn_cnn and
cifar_resnet on Fashion-MNIST at 14x14 (54,000 training images, the jobs of bench/generalization_fmnist.py's
CPU preset), so epochs have the real number of steps; and the issue's language model, the built-in gpt (2 layers
x 64 wide, T = 64, AdamW under lbt, task causal_lm) on synthetic token windows (35,000 training windows). Each
model's whole grid here (N in {1, 2} ranks as local processes, per-device batch b from 8 to 512) is measured in
up to ROUNDS rounds (at least MIN_ROUNDS, none that would end after BUDGET_S) with the profile stage's own
measurement (`step_timing.measure`). Each round runs in a shuffled order that mixes models and configurations,
inside one pair of long-lived ranks.

Each round then plays the role of one profiling campaign, judged against the other rounds:
- truth(c): median step time of configuration c over the OTHER rounds (a fit never meets its own data),
  of those the profiler saw undisturbed by other work when there are any;
- noise floor: median of |x_r(c) / truth(c) - 1| over every model, configuration and round: how far one careful
  measurement lands from the others. A model error below it cannot be shown, so error targets are ratios to it;
- partial / adaptive: fit on the round's profiles the mode chooses, error on every configuration it did
  not profile; full: leave-one-out over the grid;
- profiling cost: node-seconds the mode's profiles took (ranks x measurement wall time, warm-up, retries and
  back-off included; the launch overhead of real profile jobs is not counted), and its share of full's;
- regrets: T and cost of every candidate come from `prediction.predict_candidates` on the round's profiles of
  the mode, the choice from `choice.select`; regret = the measured T (cost) of the candidate chosen for the
  `time` (`cost`) objective over that of the candidate chosen on the truth, minus 1 (the measured T is
  predict_candidates with every step the truth). knee: |ratio - 1| of the measured T of the two knees (the knee
  minimises nothing, so a miss to either side counts).
Every figure is pooled over all models, configurations and rounds: medians, and the largest error as the
largest, with the model, round and configuration where it happened; each model's targets are judged on its own
figures too (its own noise floor), so that one job's miss is not hidden in the pool.

Beside these steady-step figures, the whole run as it really runs (bench/whole_run.py, issue 40): short training
runs of the digits models in fresh processes, each against the prediction from a profile made in a fresh process,
the whole run (first epoch included), the first and the steady epochs apart, each with its noise floor.

Design choice, made on held-out models: partial search's second batch at the largest N
(`search.partial_second_batch`: "largest" or the geometric "middle"). Each model is scored under the rule
that wins on the OTHER models (lower pooled median partial error; ties: cheaper profiling), as are its
adaptive figures; the rule all models together choose is what the default should be. Both rules' figures
are reported side by side.

Re-analysis (`--reuse FILE`) is allowed only of measurements made by this same measuring code: the file
stores a digest of the code that measures (MEASURING_CODE) and every job's profile settings, and a different
digest is refused.

On the local Slurm cluster (`--launcher slurm`, after `make slurm-up`) the pool is one 2-node sbatch job:
the ranks talk over the cluster's network, and each rank is alone on its node (ranks_per_host 1).

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/perf_accuracy.py [--launcher slurm] [--models ...]
      (about 20 min, and about 5 for the whole runs; --models tiny_cnn resnet18 where Fashion-MNIST is missing)
      .venv/bin/python bench/perf_accuracy.py --reuse bench/results/perf_accuracy.json   (re-analyse only)
Writes bench/results/perf_accuracy[_slurm].json (figures and the raw per-round measurements).
`--smoke` measures SMOKE (tiny_cnn and the gpt, two rounds so that each has a truth, six small configurations a model,
each timed once over its fewest steps) in a temporary folder, without the whole runs (`bench/whole_run.py --smoke`
runs those): the continuous-integration check that the bench runs end to end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import cloudpickle

from tula_bench import whole_run
from tula_bench.common import RESULTS, WORK, bench_parser, files_digest, parse_bench_args, smoke_scratch, write_result
from tula_bench.perf_jobs import ADAPTIVE, MODELS, NODES, PER_DEVICE, bench_jobs
from tula_bench.perf_replay import MEASUREMENT, OBJECTIVES, RULED, RULES, SEARCHES, disturbed, evaluate_model

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# A launched process cannot import bench/'s modules: its worker (pool_worker) travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A round (56 configurations) takes about 110 s here: tiny_cnn 15 s and resnet18 48 s (the sums of measure_wall_s
# per round of the previous result file); bn_cnn and cifar_resnet about 20 s each, from their step times in
# bench/generalization_fmnist.py's cells (20-200 ms per step): a configuration is 2 warm-up steps, then step pairs
# for at least 1 s and 4 pairs, plus loading. 9 rounds fit BUDGET_S, leaving about 3 minutes of the 20 to start
# the ranks and analyse; on a busy machine, where re-measured disturbances slow rounds, fewer are run.
ROUNDS = 9  # at most; at least MIN_ROUNDS, and no round that would end after BUDGET_S
MIN_ROUNDS = 3
BUDGET_S = 1020.0
# What the measurements depend on besides the jobs' profile settings: a change here invalidates stored ones. The
# import layers up to the profiles (step timing and all below it) and the train stage the whole runs go through; not
# performance/, the analysis that --reuse re-runs on stored measurements.
MEASURING_CODE = [
    *(f"tula_hpc/{layer}" for layer in ("__init__.py", "core", "cluster", "memory", "training", "profiling")),
    "tula_hpc/config.py",
    "tula_hpc/stages/train.py",
    "bench/tula_bench/whole_run.py",
]
# --smoke: two models, an image model and the GPT (each judged under the rule the other chooses), two rounds (each
# judged on the other), N in {1, 2} at three per-device batches (partial search leaves one unprofiled to judge on),
# each configuration timed once (no re-measuring on a busy machine) over search.steps step pairs however short they are
SMOKE = {
    "models": ["tiny_cnn", "gpt"],
    "rounds": 2,
    "per_device_batch": (8, 16, 32),
    "search": {"min_measure_s": 0.0, "max_attempts": 1},
}
MODES = ("partial", "adaptive", "full")
# Step-time errors in multiples of the noise floor measured in the same run; the rest as fractions.
TARGETS = {
    "partial_median": 1.2,
    "full_median": 1.0,
    "time_regret": 0.03,
    "cost_regret": 0.03,
    "knee_regret": 0.03,
    "partial_cost_share": 0.25,
}


class StaleMeasurements(ValueError):
    """Stored measurements were made by other measuring code or settings: re-analysing them judges other code."""


def measurement_digest(jobs: dict[str, Job]) -> str:
    """The measuring code and what each job's profiles depend on (stage_settings "profile": model, data, step and
    MEASUREMENT settings), with the launcher and the grid's bounds."""
    from tula_hpc.core.dependencies import stage_settings

    settings = {m: {**stage_settings(job.as_dict(), "profile"), "launcher": job.launcher} for m, job in jobs.items()}
    return files_digest(MEASURING_CODE, {"jobs": settings, "nodes": NODES, "per_device_batch": PER_DEVICE})


def reusable(stored: dict, path: Path, digest: str) -> list[dict]:
    """The stored measurements, if this code would have measured them."""
    if stored.get("measurement_digest") != digest:
        raise StaleMeasurements(
            f"{path}: its measurements carry digest {stored.get('measurement_digest')}, this code measures with "
            f"digest {digest} ({', '.join(MEASURING_CODE)} and each model's profile settings): they were made by "
            f"other measuring code or settings; measure anew"
        )
    return stored["measurements"]


def grid(job: Job, train_samples: int, smoke: bool = False) -> list[dict]:
    """The configurations measured: the whole grid, or --smoke's few."""
    from tula_hpc.stages.plan import candidate_grid

    whole = candidate_grid(job.search, PER_DEVICE[1], train_samples)
    if smoke:
        return [c for c in whole if c["per_device_batch"] in SMOKE["per_device_batch"]]
    return [c for c in whole if c["per_device_batch"] >= PER_DEVICE[0]]


def pool_worker(jobs: dict[str, Job], rounds: list[list[dict]], budget_s: float) -> list[dict] | None:
    """Both ranks walk the rounds; one-rank configurations run on rank 0 while rank 1 waits (idle).

    After MIN_ROUNDS, another round starts only if it should end within `budget_s`: on a busy machine
    re-measured disturbances make rounds slow, and the benchmark must still finish in time.
    """
    import torch
    import torch.distributed as dist

    from tula_hpc.cluster.distributed import Context, init_distributed, shutdown
    from tula_hpc.core.run_layout import devices_per_node, ranks_per_host
    from tula_hpc.profiling.step_timing import measure

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
                hosts = ranks_per_host(job.launcher, item["nodes"], devices_per_node(job))
                records.append({**item, **record, "ranks_per_host": hosts})
                print(
                    f"round {item['round']} {item['model']} N={item['nodes']} b={item['per_device_batch']}: "
                    f"{record['median']['step_s'] * 1e3:.2f} ms (interference {record['interference']:.2f})",
                    flush=True,
                )
    shutdown()
    return records if ctx.rank == 0 else None


def measure_all(
    jobs: dict[str, Job], grids: dict, rounds: int, seed: int, budget_s: float, folder: Path | None = None
) -> list[dict]:
    """Every round of every grid in one pool of ranks, its job in `folder` (default work/bench/perf_accuracy_*)."""
    from tula_hpc.cluster import launch

    rng = random.Random(seed)
    schedule = []
    for r in range(rounds):
        order = [{"round": r, "model": m, **c} for m, g in grids.items() for c in g]
        rng.shuffle(order)
        schedule.append(order)
    os.environ.setdefault("TULA_COLLECTIVE_TIMEOUT_S", "3600")  # a rank may wait out a long one-rank measurement
    job = next(iter(jobs.values()))  # every job has the same launcher and resources
    spec = launch.LaunchSpec.for_job(job, nodes=NODES[-1])
    return launch.run(
        pool_worker,
        dict(jobs=jobs, rounds=schedule, budget_s=budget_s),
        spec,
        folder or WORK / f"perf_accuracy_{job.launcher}",
        name="bench-perf-accuracy",
    )


def largest(items: list[dict], key: str) -> dict | None:
    """The largest `key` of `items`, with the model, round (and configuration) where it happened."""
    if not items:
        return None
    top = max(items, key=lambda item: item[key])
    return {"value": top[key], **{k: top[k] for k in ("model", "round", "nodes", "batch") if k in top}}


def noise_summary(noise: list[dict]) -> dict:
    quiet = [n["error"] for n in noise if not n["disturbed"]]
    loud = [n["error"] for n in noise if n["disturbed"]]
    return {
        "noise_floor": statistics.median(n["error"] for n in noise),
        "noise_max": largest(noise, "error"),
        # How far measurements the profiler saw as quiet, and those it saw disturbed, land from the truth.
        "noise_quiet": statistics.median(quiet) if quiet else None,
        "noise_disturbed": statistics.median(loud) if loud else None,
        "disturbed": len(loud),
    }


def summarise(errors: list[dict], campaigns: list[dict], noise_floor: float) -> dict:
    """Medians and maxima over all the errors and campaigns given (pooled over models and rounds)."""
    values = [e["error"] for e in errors]
    median = statistics.median(values) if values else None
    return {
        "median_rel_error": median,
        "max_rel_error": largest(errors, "error"),
        "error_over_noise_floor": None if median is None else median / noise_floor,
        "profiled_configs": statistics.median(c["profiled"] for c in campaigns),
        "profiling_cost_s": statistics.median(c["cost_s"] for c in campaigns),
        "profiling_cost_share_of_full": statistics.median(c["cost_share"] for c in campaigns),
        **{f"{goal}_regret": statistics.median(c[f"{goal}_regret"] for c in campaigns) for goal in OBJECTIVES},
        **{f"{goal}_regret_max": largest(campaigns, f"{goal}_regret") for goal in OBJECTIVES},
    }


def rule_scores(raw: dict[str, dict], models: list[str]) -> dict[str, dict]:
    """Per second-batch rule, partial search's pooled median error and profiling cost share on `models`."""
    return {
        rule: {
            "median_rel_error": statistics.median(
                e["error"] for m in models for e in raw[m]["errors"][f"partial/{rule}"]
            ),
            "profiling_cost_share_of_full": statistics.median(
                c["cost_share"] for m in models for c in raw[m]["campaigns"][f"partial/{rule}"]
            ),
        }
        for rule in RULES
    }


def best_rule(scores: dict[str, dict]) -> str:
    """The lower median error; on a tie, the cheaper profiling."""
    return min(scores, key=lambda r: (scores[r]["median_rel_error"], scores[r]["profiling_cost_share_of_full"]))


def judged(overall: dict, noise_floor: float) -> dict[str, dict]:
    """Every target with its figure and whether it is met: errors as ratios to the noise floor, the regret of
    each objective as its worst mode's median."""
    figures = {
        "partial_median": overall["partial"]["median_rel_error"] / noise_floor,
        "full_median": overall["full"]["median_rel_error"] / noise_floor,
        **{f"{goal}_regret": max(overall[mode][f"{goal}_regret"] for mode in MODES) for goal in OBJECTIVES},
        "partial_cost_share": overall["partial"]["profiling_cost_share_of_full"],
    }
    return {
        name: {"figure": figure, "target": TARGETS[name], "met": bool(figure <= TARGETS[name])}
        for name, figure in figures.items()
    }


def analyse(raw: dict[str, dict]) -> dict:
    """Pooled figures; each model's partial and adaptive figures under the second-batch rule chosen on the others."""
    models = list(raw)
    rules = {m: best_rule(rule_scores(raw, [o for o in models if o != m])) for m in models}
    searched = {
        **{search: {m: search for m in models} for search in SEARCHES},
        **{mode: {m: f"{mode}/{rules[m]}" for m in models} for mode in ("partial", "adaptive")},
    }
    noise = [n for m in models for n in raw[m]["noise"]]
    noise_floor = statistics.median(n["error"] for n in noise)

    def pooled(label: str, among: list[str], floor: float) -> dict:
        return summarise(
            [e for m in among for e in raw[m]["errors"][searched[label][m]]],
            [c for m in among for c in raw[m]["campaigns"][searched[label][m]]],
            floor,
        )

    overall = {label: pooled(label, models, noise_floor) for label in MODES + RULED}
    per_model = {}
    for m in models:
        floor = statistics.median(n["error"] for n in raw[m]["noise"])
        modes = {label: pooled(label, [m], floor) for label in MODES + RULED}
        per_model[m] = {
            "configs": raw[m]["configs"],
            "rounds": raw[m]["rounds"],
            **noise_summary(raw[m]["noise"]),
            "second_batch": {
                "rule": rules[m],
                "on_other_models": rule_scores(raw, [o for o in models if o != m]),
                "held_out_median_rel_error": modes["partial"]["median_rel_error"],
                "held_out_max_rel_error": modes["partial"]["max_rel_error"],
            },
            "modes": modes,
            "targets": judged(modes, floor),
        }
    on_all = rule_scores(raw, models)
    return {
        **noise_summary(noise),
        "targets": judged(overall, noise_floor),
        "second_batch": {"default": best_rule(on_all), "on_all_models": on_all, "per_model": rules},
        "overall": overall,
        "models": per_model,
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _at(worst: dict | None) -> str:
    if worst is None:
        return "-"
    config = f" N={worst['nodes']} B={worst['batch']}" if "nodes" in worst else ""
    return f"{worst['value']:.1%} ({worst['model']} round {worst['round']}{config})"


def report(analysis: dict, disturbed_share: float) -> None:
    print(
        f"noise floor (median relative spread of repeated measurements, all models): {analysis['noise_floor']:.1%}, "
        f"largest {_at(analysis['noise_max'])}; {disturbed_share:.0%} of the measurements stayed disturbed"
    )
    for m, r in analysis["models"].items():
        print(
            f"{m}: noise floor {r['noise_floor']:.1%} (quiet {_percent(r['noise_quiet'])}, {r['disturbed']} "
            f"disturbed {_percent(r['noise_disturbed'])}); second batch '{r['second_batch']['rule']}' (chosen on "
            f"the other models), held-out partial median {_percent(r['second_batch']['held_out_median_rel_error'])}"
        )
        for label, s in r["modes"].items():
            print(f"  {label:16s} {_figures(s)}")
        for name, t in r["targets"].items():
            print(f"  target {name:18s} {_target(name, t)}")
    for label, s in analysis["overall"].items():
        print(f"overall {label:16s} {_figures(s)}")
    choice = analysis["second_batch"]
    scores = ", ".join(
        f"{rule}: median {s['median_rel_error']:.1%}, cost {s['profiling_cost_share_of_full']:.0%} of full"
        for rule, s in choice["on_all_models"].items()
    )
    print(f"second batch on all models: {scores}; the default should be '{choice['default']}'")
    for name, t in analysis["targets"].items():
        print(f"target {name:18s} {_target(name, t)}")


def _target(name: str, t: dict) -> str:
    shown = (
        f"{t['figure']:.2f}x noise floor (target <= {t['target']}x)"
        if name.endswith("_median")
        else f"{t['figure']:.1%} (target <= {t['target']:.0%})"
    )
    return f"{'met' if t['met'] else 'NOT met'}: {shown}"


def _figures(s: dict) -> str:
    regret = " ".join(f"{g} {s[f'{g}_regret']:.1%} (max {_at(s[f'{g}_regret_max'])})" for g in OBJECTIVES)
    over = "-" if s["error_over_noise_floor"] is None else f"{s['error_over_noise_floor']:.2f}"
    return (
        f"median {_percent(s['median_rel_error'])} ({over}x noise) max {_at(s['max_rel_error'])}  "
        f"profiled {s['profiled_configs']:4.1f}  cost {s['profiling_cost_s']:6.1f} node-s "
        f"({s['profiling_cost_share_of_full']:.0%} of full)  regret {regret}"
    )


def run_settings(launcher: str, jobs: dict, train_samples: dict, stored: dict | None, args) -> dict:
    """The result's settings: those of the run that measured where the measurements are re-analysed."""
    return {
        "smoke": stored["settings"].get("smoke", False) if stored else args.smoke,
        "launcher": launcher,
        "models": {m: MODELS[m] for m in jobs},
        "train_samples": train_samples,
        "nodes": NODES,
        "per_device_batch": PER_DEVICE,
        "max_rounds": stored["settings"]["max_rounds"] if stored else args.rounds,
        "seed": stored["settings"]["seed"] if stored else args.seed,
        "budget_s": BUDGET_S,
        "measurement": MEASUREMENT,
        "adaptive": ADAPTIVE,
        "jobs": {m: job.as_dict() for m, job in jobs.items()},
    }


def options_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "perf_accuracy.json")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reuse", type=Path, help="re-analyse the measurements of an earlier result file made by this measuring code"
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="slurm: the pool is one job on the local Slurm cluster (make slurm-up first); "
        "the result goes to perf_accuracy_slurm.json unless --out says otherwise",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        help="the models measured (default: all; bn_cnn and cifar_resnet need Fashion-MNIST's files)",
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest case (SMOKE) in a temporary folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = options_parser()
    args = parse_bench_args(parser, argv)
    if args.smoke and (args.reuse or args.launcher != "local"):
        parser.error("--smoke measures anew on the local launcher")
    if args.smoke:
        args.models, args.rounds = SMOKE["models"], SMOKE["rounds"]

    from tula_hpc.core.atomic_files import read_json
    from tula_hpc.training.datasets import load_splits

    stored = read_json(args.reuse) if args.reuse else None
    launcher = stored["settings"]["launcher"] if stored else args.launcher
    out = args.out
    if launcher != "local" and out == parser.get_default("out"):
        out = RESULTS / f"perf_accuracy_{launcher}.json"
    models = list(stored["settings"].get("models", MODELS)) if stored else args.models
    jobs = {m: job for m, job in bench_jobs(launcher).items() if m in models}
    if args.smoke:
        jobs = {m: job.updated(search=SMOKE["search"]) for m, job in jobs.items()}
    digest = measurement_digest(jobs)
    try:
        records = reusable(stored, args.reuse, digest) if stored else None
    except StaleMeasurements as err:
        parser.error(str(err))
    train_samples = {m: len(load_splits(job.data, job.train.seed).train) for m, job in jobs.items()}
    grids = {m: grid(jobs[m], train_samples[m], args.smoke) for m in jobs}
    short_runs = {m: jobs[m] for m in whole_run.MODELS if m in jobs}
    if records is None:
        started = time.time()
        folder = smoke_scratch("perf-accuracy") if args.smoke else None
        records = measure_all(jobs, grids, args.rounds, args.seed, BUDGET_S, folder)
        runs = [] if args.smoke else whole_run.measure(short_runs)
        measure_wall, measured_with = time.time() - started, None
    else:  # re-analysis keeps the provenance of the run that measured; the header says what analysed them
        measure_wall, measured_with = stored["measure_wall_s"], stored["measured_with"] or stored["provenance"]
        runs = (stored.get("whole_run") or {}).get("runs", [])
    raw = {
        m: evaluate_model(m, jobs[m], grids[m], [r for r in records if r["model"] == m], train_samples[m]) for m in jobs
    }
    analysis = analyse(raw)
    whole = whole_run.analyse(runs, jobs, train_samples) if runs else None
    settings = run_settings(launcher, jobs, train_samples, stored, args)
    disturbed_share = sum(map(disturbed, records)) / len(records)
    figures = {
        "description": "step-time prediction error on configurations not used in the fit (full: leave-one-out), "
        "and the regret of the select stage's choice, per search mode; pooled over models, configurations and "
        "rounds (medians, and maxima with where they happened); partial and adaptive under the second-batch rule "
        "chosen on the other models",
        "machine": {
            "load_avg_at_end": os.getloadavg(),
            "median_interference": statistics.median(r.get("interference", 0.0) for r in records),
            "disturbed_share": disturbed_share,
        },
        "rounds": len({r["round"] for r in records}),
        **analysis,
        "whole_run": whole,
        "measure_wall_s": measure_wall,
        "reanalysed": bool(stored),
        "measured_with": measured_with,
        "measurement_digest": digest,
        "measurements": records,
    }
    write_result(out, settings, figures)
    report(analysis, disturbed_share)
    if whole is not None:
        whole_run.report(whole)
    return 0
