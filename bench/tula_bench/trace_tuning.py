"""Benchmark: the constants of the search that confirms its choice, chosen out of fold on the two tuned GPU traces.

Why (issue 41): K (search.confirm), the band a rival must lie within to be measured (choice.CONFIRM_BAND_SIGMAS) and
the tie rule's threshold (choice.TIE_SIGMAS) are chosen on one model's replay and judged on the other's, both ways,
so that no figure in trace_accuracy.json was tuned on itself. The replay is trace_accuracy's (partial search, the
default mode, each GPUs-per-node g alone, every profile read with the traces' roughness as noise, SEEDS seeds).

Score of a setting on a model (lower is better): the sum of its four regret figures (time and cost, mean and worst)
each over its target (trace_accuracy.TARGETS), among settings whose profile_cost_share and knee_same_share meet their
targets; equal scores go to the cheaper search (smaller K, then narrower band). The defaults in choice.py and
config/jobs.yaml are the setting both folds agree on, or, where they differ, the one with the better worse fold; the
note says which. Where the folds differ on the tie threshold alone, it also answers to the measured CPU profiles
(bench/perf_accuracy.py; choice.py's comment says how).

Run:  .venv/bin/python bench/trace_tuning.py [--traces DIR] [--out FILE]   (about 15 min on 2 cores; CPU only)
      .venv/bin/python bench/trace_tuning.py --smoke --out FILE   (seconds: one seed, each model's smallest case as
      trace_accuracy's smoke run replays it, two values of each constant; CI's check, its choice meaningless)
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from pathlib import Path

from tula_bench.common import bench_parser, parse_bench_args, provenance, write_and_report
from tula_bench.trace_accuracy import SEEDS, SYNC_MAPPINGS, TRACES, load_traces, replay, traces_roughness
from tula_bench.trace_figures import TARGETS, median_or_none, mode_figures, over_seeds

GRID = {"confirm": (0, 1, 2, 3, 4), "band_sigmas": (1.0, 2.0, 3.0), "tie_sigmas": (0.0, 0.5, 1.0)}
SMOKE_GRID = {"confirm": (0, 2), "band_sigmas": (1.0, 2.0), "tie_sigmas": (0.0, 1.0)}
REGRETS = ("time_regret_mean", "time_regret_max", "cost_regret_mean", "cost_regret_max")
KEPT = (*REGRETS, "profile_cost_share", "profile_cost_share_max", "knee_same_share", "confirming_profiles_mean")


def settings_figures(trace: dict, band: float, grid: dict, mapping: str, seeds: int, noise: float) -> list[dict]:
    """Every (K, tie) of `grid` at this band on one model, partial search: KEPT figures averaged over the seeds. One
    process, one cache of fits: K and the tie threshold change which fits are read, rarely which are made."""
    fits: dict = {}
    found = []
    for confirm, tie in itertools.product(grid["confirm"], grid["tie_sigmas"]):
        constants = {"confirm": confirm, "band_sigmas": band, "tie_sigmas": tie}
        per_seed = [
            mode_figures(
                [replay(trace, (g,), mapping, seed, noise, constants, ("partial",), fits) for g in trace["gpus"]],
                "partial",
            )
            for seed in range(seeds)
        ]
        figures = over_seeds(per_seed)
        found.append({**constants, **{key: figures[key] for key in KEPT}})
    return found


def score(figures: dict) -> float:
    """The four regret figures, each over its target; infinite where the search costs more than its target or the
    knee is found less often than its target (K confirms the knee's choice too; a score of regrets alone chose K=2,
    which found ImageNet's knee in 75 % of the replays)."""
    if figures["profile_cost_share"] > TARGETS["profile_cost_share"][1]:
        return float("inf")
    if figures["knee_same_share"] < TARGETS["knee_same_share"][1]:
        return float("inf")
    return sum(figures[key] / TARGETS[key][1] for key in REGRETS)


def best_setting(table: list[dict]) -> dict:
    return min(table, key=lambda f: (score(f), f["confirm"], f["band_sigmas"], f["tie_sigmas"]))


def _same_setting(a: dict, b: dict) -> bool:
    return all(a[key] == b[key] for key in ("confirm", "band_sigmas", "tie_sigmas"))


def run(
    traces: Path,
    mapping: str = SYNC_MAPPINGS[0],
    seeds: int = SEEDS,
    noise: float | None = None,
    smoke: bool = False,
) -> dict:
    """Both folds over the grid (`smoke`: SMOKE_GRID on each model's smallest case); the result file's contents."""
    loaded = load_traces(traces, smoke)
    rough = median_or_none([r["error"] for r in traces_roughness(loaded)])
    noise = rough if noise is None else noise
    grid = SMOKE_GRID if smoke else GRID
    tasks = [(trace, band, grid, mapping, seeds, noise) for trace in loaded for band in grid["band_sigmas"]]
    with multiprocessing.Pool(min(len(tasks), os.cpu_count() or 1)) as pool:
        tables = pool.starmap(settings_figures, tasks)
    by_model: dict[str, list[dict]] = {}
    for (trace, *_), table in zip(tasks, tables):
        by_model.setdefault(trace["name"], []).extend(table)
    folds = []
    for tuned, judged in itertools.permutations(by_model, 2):
        chosen = best_setting(by_model[tuned])
        on_judged = next(f for f in by_model[judged] if _same_setting(f, chosen))
        folds.append(
            {
                "tuned_on": tuned,
                "judged_on": judged,
                "chosen": {key: chosen[key] for key in ("confirm", "band_sigmas", "tie_sigmas")},
                "tuned_figures": chosen,
                "judged_figures": on_judged,
                "judged_score": score(on_judged),
                "judged_best_score": score(best_setting(by_model[judged])),
            }
        )
    return {
        "summary": {
            "folds": [
                {k: fold[k] for k in ("tuned_on", "judged_on", "chosen", "judged_score", "judged_best_score")}
                | {key: fold["judged_figures"][key] for key in (*REGRETS, "profile_cost_share")}
                for fold in folds
            ],
        },
        "folds": folds,
        "noise": {"seeds": seeds, "sigma": noise},
        "grid": grid,
        "settings": {"smoke": smoke, "traces": str(traces), "sync_mapping": mapping},
        "provenance": provenance(),
        "tables": by_model,
    }


def report(result: dict) -> None:
    for fold in result["folds"]:
        chosen, judged = fold["chosen"], fold["judged_figures"]
        print(
            f"tuned on {fold['tuned_on']}: K={chosen['confirm']} band={chosen['band_sigmas']:g} sigma "
            f"tie={chosen['tie_sigmas']:g} sigma; judged on {fold['judged_on']}: time regret mean "
            f"{judged['time_regret_mean']:.1%} worst {judged['time_regret_max']:.1%}, cost regret mean "
            f"{judged['cost_regret_mean']:.1%} worst {judged['cost_regret_max']:.1%}, profile cost share "
            f"{judged['profile_cost_share']:.1%} (score {fold['judged_score']:.2f}; its own best "
            f"{fold['judged_best_score']:.2f})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "trace_tuning.json")
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of <model>/ traces (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="noise seeds averaged over (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="one seed, the smallest cases, a 2x2x2 grid (CI's check)")
    args = parse_bench_args(parser, argv)
    return write_and_report(args.out, run(args.traces, seeds=1 if args.smoke else args.seeds, smoke=args.smoke), report)
