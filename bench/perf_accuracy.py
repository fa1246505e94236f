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
- time_regret, cost_regret: T and cost of every candidate come from the fit_model stage's own code
  (`perfmodel.predict_candidates` on the round's profiles of the mode) and the choice from the select
  stage's (`selection.select`); regret = the measured T (cost) of the candidate chosen for the `time`
  (`cost`) objective over that of the candidate chosen on the measured truth, minus 1. The measured T is
  predict_candidates with every step the truth (only the epoch's last, smaller step scales as a model fitted
  to the other rounds says). knee_regret: |measured T of the chosen knee over that of the knee chosen on the
  truth - 1| (the knee minimises nothing, so a miss to either side counts).

On the local Slurm cluster (`--launcher slurm`, after `make slurm-up`) the pool is one 2-node sbatch job:
the ranks talk over the cluster's network, and, as on any cluster, the model knows each rank alone on
its node (ranks_per_host 1), so partial search profiles 3 configurations instead of 4.

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/perf_accuracy.py [--launcher slurm]
      .venv/bin/python bench/perf_accuracy.py --reuse bench/results/perf_accuracy.json   (re-analyse only)
Writes bench/results/perf_accuracy[_slurm].json (figures and the raw per-round measurements).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

from common import RESULTS, WORK, bench_job, bench_parser, write_result

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
MODES = ("partial", "adaptive", "full")
OBJECTIVES = ("time", "cost", "knee")
# Costs are node-hours (the bench jobs' pricing), which read no memory.json; pricing.costs prices every
# pricing model at once, so it gets a zero memory line for the one this bench does not use.
NO_MEMORY = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}


def bench_jobs(launcher: str) -> dict[str, dict]:
    jobs = {}
    for model, side in MODELS.items():
        jobs[model] = bench_job(
            as_name=f"bench-{model}",
            launcher=launcher,
            model={"name": model},
            data={"name": "digits", "image_size": side},
            search={
                **MEASUREMENT,
                "adaptive": ADAPTIVE,
                "nodes": {"min": NODES[0], "max": NODES[-1]},
                "batch": {"min": PER_DEVICE[0], "max": NODES[-1] * PER_DEVICE[1]},
            },
            objective={"pricing": "node_hour"},
            resources={"time_min": 60},  # the whole pool is one job
        )
    return jobs


def grid(job: dict, train_samples: int) -> list[dict]:
    from tula_hpc.layout import devices_per_node
    from tula_hpc.plan import candidate_grid

    return [
        c
        for c in candidate_grid(job["search"], devices_per_node(job), PER_DEVICE[1], train_samples)
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
    from tula_hpc.layout import devices_per_node, ranks_per_host
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
                hosts = ranks_per_host(job["launcher"], item["nodes"], devices_per_node(job))
                records.append({**item, **record, "ranks_per_host": hosts})
                print(
                    f"round {item['round']} {item['model']} N={item['nodes']} b={item['per_device_batch']}: "
                    f"{record['median']['step_s'] * 1e3:.2f} ms (interference {record['interference']:.2f})",
                    flush=True,
                )
    shutdown()
    return records if ctx.rank == 0 else None


def measure_all(jobs: dict, grids: dict, rounds: int, seed: int, budget_s: float) -> list[dict]:
    from tula_hpc import launch

    rng = random.Random(seed)
    schedule = []
    for r in range(rounds):
        order = [{"round": r, "model": m, **c} for m, g in grids.items() for c in g]
        rng.shuffle(order)
        schedule.append(order)
    os.environ.setdefault("TULA_COLLECTIVE_TIMEOUT_S", "3600")  # a rank may wait out a long one-rank measurement
    job = next(iter(jobs.values()))
    spec = launch.LaunchSpec.for_job(job, nodes=NODES[-1])
    return launch.run(
        pool_worker,
        dict(jobs=jobs, rounds=schedule, budget_s=budget_s),
        spec,
        WORK / f"perf_accuracy_{job['launcher']}",
        name="bench-perf-accuracy",
    )


def _key(c: dict) -> tuple[int, int]:
    return c["nodes"], c["batch"]


def disturbed(record: dict) -> bool:
    return record["interference"] > MEASUREMENT["interference_tolerance"]


def _rel(predicted: float, measured: float) -> float:
    return float(abs(predicted / measured - 1))


def stage_prediction(job: dict, profiles: list[dict], candidates: list[dict], train_samples: int, settings: dict):
    """T and cost of every candidate as the fit_model stage computes them from these profiles."""
    from tula_hpc.perfmodel import fit_and_predict

    return fit_and_predict(job, profiles, candidates, train_samples, NO_MEMORY, settings)[3]


def regrets(predicted: list[dict], measured: list[dict], objective: dict) -> dict[str, float]:
    """Per objective: what the select stage's choice on the prediction measures, against its choice on the truth."""
    from tula_hpc.selection import select

    truth = {_key(c): c for c in measured}
    found = {}
    for goal in OBJECTIVES:
        wanted = {**objective, "minimize": goal}
        chosen = select({"candidates": predicted, "pricing": objective["pricing"]}, wanted)["chosen"]
        best = select({"candidates": measured, "pricing": objective["pricing"]}, wanted)["chosen"]
        field = "cost" if goal == "cost" else "time_s"
        regret = truth[_key(chosen)][field] / best[field] - 1
        found[goal] = abs(regret) if goal == "knee" else regret
    return found


def evaluate_model(job: dict, candidates: list[dict], records: list[dict], train_samples: int) -> dict:
    from tula_hpc.layout import devices_per_node
    from tula_hpc.perfmodel import predict_candidates
    from tula_hpc.performance import adaptive_search, candidate_row, fit_profiles, model_params
    from tula_hpc.search import planned

    devices, launcher = devices_per_node(job), job["launcher"]

    def rows(configs: list[dict]) -> list[list[float]]:
        return [candidate_row(c, devices, launcher) for c in configs]

    rounds = sorted({r["round"] for r in records})
    by_round = {r: {_key(x): x for x in records if x["round"] == r} for r in rounds}
    settings = model_params(job)
    search = job["search"]

    def truth(c, excluded):
        """Median over the other rounds, of their quiet measurements when there are any."""
        others = [by_round[r][_key(c)] for r in rounds if r != excluded]
        quiet = [x for x in others if not disturbed(x)] or others
        return statistics.median(x["median"]["step_s"] for x in quiet)

    def measured_run(excluded) -> list[dict]:
        """T and cost of every candidate from its true step (weight 1: the model only scales the last step)."""
        elsewhere = [x for r in rounds if r != excluded for x in by_round[r].values()]
        steps = {(c["nodes"] * devices, c["per_device_batch"]): truth(c, excluded) for c in candidates}
        model = fit_profiles(elsewhere, **settings)
        return predict_candidates(model, candidates, job, train_samples, NO_MEMORY, steps, 1.0)

    def cost(used, r) -> float:
        return sum(by_round[r][_key(c)]["measure_wall_s"] * c["nodes"] for c in used)

    modes: dict[str, dict] = {
        m: {"errors": [], "costs": [], "profiled": [], **{goal: [] for goal in OBJECTIVES}} for m in MODES
    }
    for current in rounds:
        profiles = by_round[current]
        measure = lambda c, profiles=profiles: profiles[_key(c)]  # noqa: E731  (the round's measurement stands in for a profile job)
        chosen = {mode: planned(mode, candidates, devices, launcher) for mode in MODES}
        adaptive = adaptive_search(
            candidates,
            chosen["adaptive"],
            measure,
            lambda c: candidate_row(c, devices, launcher),
            settings,
            search["adaptive"]["tolerance"],
            search["adaptive"]["max_profiles"],
        )
        chosen["adaptive"] = adaptive["profiled"]
        fit_settings = {
            "partial": settings,
            "adaptive": {**settings, "discrepancy_per_octave": adaptive["discrepancy_per_octave"]},
            "full": settings,
        }
        for mode in ("partial", "adaptive"):
            model = fit_profiles([measure(c) for c in chosen[mode]], **settings)
            unseen = [c for c in candidates if c not in chosen[mode]]
            modes[mode]["errors"] += [_rel(p, truth(c, current)) for c, p in zip(unseen, model.predict(rows(unseen)))]
        for held in candidates:
            rest = [measure(c) for c in candidates if c is not held]
            model = fit_profiles(rest, **settings)
            step = model.predict(rows([held]))[0]
            modes["full"]["errors"].append(_rel(step, truth(held, current)))
        measured = measured_run(current)
        for mode, used in chosen.items():
            predicted = stage_prediction(job, [measure(c) for c in used], candidates, train_samples, fit_settings[mode])
            for goal, regret in regrets(predicted, measured, job["objective"]).items():
                modes[mode][goal].append(regret)
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
            **{f"{goal}_regret": statistics.median(m[goal]) for goal in OBJECTIVES},
            **{f"{goal}_regret_max": max(m[goal]) for goal in OBJECTIVES},
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
    parser = bench_parser(__doc__, "perf_accuracy.json")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", type=Path, help="re-analyse the measurements stored in an earlier result file")
    parser.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="slurm: the pool is one job on the local Slurm cluster (make slurm-up first); "
        "the result goes to perf_accuracy_slurm.json unless --out says otherwise",
    )
    args = parser.parse_args()

    from tula_hpc.data import load_splits
    from tula_hpc.files import read_json

    reused = read_json(args.reuse) if args.reuse else None
    launcher = reused["settings"].get("launcher", "local") if reused else args.launcher
    out = args.out
    if launcher != "local" and out == parser.get_default("out"):
        out = RESULTS / f"perf_accuracy_{launcher}.json"
    jobs = bench_jobs(launcher)
    train_samples = len(load_splits(next(iter(jobs.values()))["data"], 0).train)
    grids = {m: grid(job, train_samples) for m, job in jobs.items()}
    started = time.time()
    if reused:
        records, measure_wall = reused["measurements"], reused.get("measure_wall_s")
    else:
        records = measure_all(jobs, grids, args.rounds, args.seed, BUDGET_S)
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
            for key in ("median_rel_error", "max_rel_error", "profiling_cost_share_of_full")
            + tuple(f"{goal}_regret" for goal in OBJECTIVES)
        }
        for mode in MODES
    }
    noise_floor = statistics.median(r["noise_floor"] for r in results.values())
    met = {
        "partial_median": bool(overall["partial"]["median_rel_error"] <= TARGETS["partial_median"]),
        "full_median": bool(overall["full"]["median_rel_error"] <= TARGETS["full_median"]),
        **{
            f"{goal}_regret": bool(max(overall[m][f"{goal}_regret"] for m in MODES) <= TARGETS["regret"])
            for goal in ("time", "cost")
        },
        "partial_cost_share": bool(overall["partial"]["profiling_cost_share_of_full"] <= TARGETS["partial_cost_share"]),
    }
    settings = {
        "launcher": launcher,
        "models": MODELS,
        "nodes": NODES,
        "per_device_batch": PER_DEVICE,
        "max_rounds": reused["settings"]["max_rounds"] if reused else args.rounds,
        "seed": reused["settings"].get("seed") if reused else args.seed,
        "budget_s": BUDGET_S,
        "measurement": MEASUREMENT,
        "adaptive": ADAPTIVE,
        "jobs": jobs,
    }
    figures = {
        "description": "step-time prediction error on configurations not used in the fit (full: leave-one-out), "
        "and the regret of the select stage's choice, per search mode; medians over models of per-model figures",
        "machine": {
            "load_avg_at_end": os.getloadavg(),
            "median_interference": statistics.median(r.get("interference", 0.0) for r in records),
            "disturbed_share": sum(map(disturbed, records)) / len(records),
        },
        "rounds": len({r["round"] for r in records}),
        "targets": TARGETS,
        "targets_met": met,
        "noise_floor": noise_floor,
        "overall": overall,
        "models": results,
        "measure_wall_s": measure_wall,
        "reanalysed": bool(reused),
        # Re-analysis keeps where the measurements came from; the header says what analysed them.
        "measured_with": reused.get("provenance") if reused else None,
        "measurements": records,
    }
    write_result(out, settings, figures)
    print(
        f"noise floor (median relative spread of repeated measurements): {noise_floor:.1%}; "
        f"{figures['machine']['disturbed_share']:.0%} of the measurements stayed disturbed by other work"
    )
    for m, r in results.items():
        disturbed_noise = "-" if r["noise_disturbed"] is None else f"{r['noise_disturbed']:.1%}"
        print(
            f"{m}: noise floor {r['noise_floor']:.1%} (quiet measurements {r['noise_quiet']:.1%}, "
            f"{r['disturbed']} disturbed ones {disturbed_noise})"
        )
        for mode, s in r["modes"].items():
            regret = " ".join(f"{goal} {s[f'{goal}_regret']:.1%}" for goal in OBJECTIVES)
            if s["median_rel_error"] is None:
                print(f"  {mode:8s} profiled every configuration in every round: no error to judge; regret {regret}")
                continue
            print(
                f"  {mode:8s} median {s['median_rel_error']:6.1%} max {s['max_rel_error']:6.1%} "
                f"({s['error_over_noise_floor']:.1f}x noise)  profiled {s['profiled_configs']:4.1f}  "
                f"cost {s['profiling_cost_s']:6.1f} node-s ({s['profiling_cost_share_of_full']:.0%} of full)  "
                f"regret {regret}"
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
