"""The trace replay's figures (bench/trace_accuracy.py): pooled over the replayed models and GPUs per node, averaged
over noise seeds (the worst case the worst of all), judged against the targets, and printed."""

from __future__ import annotations

import statistics

GOALS = ("time", "cost", "knee")  # each its own job, with its own confirming profiles
# Issue 25's targets: errors and regrets at most, knee share at least, coverage within a band.
TARGETS = {
    "partial_median_error": ("max", 0.07),
    "partial_max_error": ("max", 0.30),
    "full_loo_median_error": ("max", 0.05),
    "time_regret_mean": ("max", 0.02),
    "time_regret_max": ("max", 0.10),
    "cost_regret_mean": ("max", 0.02),
    "cost_regret_max": ("max", 0.10),
    "knee_same_share": ("min", 0.90),
    "sigma1_coverage": ("band", (0.60, 0.75)),
    "profile_cost_share": ("max", 0.30),  # issue 41: the search's device-seconds against the whole grid's
}
STEP_ERRORS = ("partial_median_error", "partial_max_error", "full_loo_median_error")


def largest_by(items: list[dict], key: str) -> dict | None:
    return max(items, key=lambda item: item[key]) if items else None


def median_or_none(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def mode_figures(cases: list[dict], mode: str) -> dict:
    """One search mode's figures pooled over the replayed (model, g) cases of one seed."""
    errors = [e for case in cases for e in case["modes"][mode]["errors"]]
    picks = [
        dict(p, model=c["model"], gpus_per_node=c["gpus_per_node"]) for c in cases for p in c["modes"][mode]["choices"]
    ]
    regrets = {goal: [p[f"{goal}_regret"] for p in picks] for goal in ("time", "cost")}
    shares = [p[f"{goal}_profile_cost_share"] for p in picks for goal in GOALS]
    confirmed = [len(p[f"{goal}_confirmed"]) for p in picks for goal in GOALS]
    figures = {
        "unprofiled": len(errors),
        "median_error": median_or_none([e["error"] for e in errors]),
        "max_error": largest_by(errors, "error"),
        "sigma1_coverage": (sum(e["error"] <= e["rel_uncertainty"] for e in errors) / len(errors)) if errors else None,
        "median_rel_uncertainty": median_or_none([e["rel_uncertainty"] for e in errors]),
        "loo_median_error": median_or_none([x for case in cases for x in case["modes"][mode]["leave_one_out"]]),
        "loo_count": sum(len(case["modes"][mode]["leave_one_out"]) for case in cases),
        "knee_same_share": sum(p["knee_same"] for p in picks) / len(picks),
        "worst_time_regret": largest_by(picks, "time_regret"),
        "worst_cost_regret": largest_by(picks, "cost_regret"),
        "time_same_gpus_per_node_share": sum(p["time_same_gpus_per_node"] for p in picks) / len(picks),
        "cost_same_gpus_per_node_share": sum(p["cost_same_gpus_per_node"] for p in picks) / len(picks),
        "profile_cost_share": statistics.fmean(shares),
        "profile_cost_share_max": max(shares),
        "confirming_profiles_mean": statistics.fmean(confirmed),
        "tied_share": sum(p[f"{goal}_tied"] for p in picks for goal in GOALS) / (len(picks) * len(GOALS)),
    }
    for goal, values in regrets.items():
        figures[f"{goal}_regret_mean"] = statistics.fmean(values)
        figures[f"{goal}_regret_max"] = max(values)
    if mode == "adaptive":
        added = [case["modes"][mode]["adaptive"]["added"] for case in cases]
        figures["profiles_added"] = added
        figures["stopped_after_one_added_share"] = sum(a <= 1 for a in added) / len(added)
    return figures


def summarise(cases: list[dict], mode: str) -> dict:
    """The summary object of one seed (fractions): `mode`'s figures, and full search's leave-one-out median."""
    chosen = mode_figures(cases, mode)
    partial = chosen if mode == "partial" else mode_figures(cases, "partial")
    full = mode_figures(cases, "full") if "full" in cases[0]["modes"] else {"loo_median_error": None}
    return {
        "partial_median_error": partial["median_error"],
        "partial_max_error": partial["max_error"]["error"],
        "full_loo_median_error": full["loo_median_error"],
        "time_regret_mean": chosen["time_regret_mean"],
        "time_regret_max": chosen["time_regret_max"],
        "cost_regret_mean": chosen["cost_regret_mean"],
        "cost_regret_max": chosen["cost_regret_max"],
        "knee_same_share": chosen["knee_same_share"],
        "sigma1_coverage": chosen["sigma1_coverage"],
        "profile_cost_share": chosen["profile_cost_share"],
    }


# A worst case of mode_figures -> the figure that makes it the worst.
WORST_OF = {"max_error": "error", "worst_time_regret": "time_regret", "worst_cost_regret": "cost_regret"}


def over_seeds(per_seed: list[dict]) -> dict:
    """Figures of several seeds in one: each number averaged, each worst case the worst of all seeds (with its seed),
    each list joined."""
    merged: dict = {}
    for key, first in per_seed[0].items():
        values = [figures[key] for figures in per_seed]
        if any(v is None for v in values):
            merged[key] = None
        elif key in WORST_OF:
            merged[key] = max((dict(v, seed=seed) for seed, v in enumerate(values)), key=lambda v: v[WORST_OF[key]])
        elif isinstance(first, list):
            merged[key] = [x for v in values for x in v]
        else:
            merged[key] = statistics.fmean(values)
    return merged


def verdicts(summary: dict, rough: float | None) -> dict:
    """Each issue-25 target as met or not; a step-error target below the traces' roughness says so."""
    found = {}
    for key, (kind, target) in TARGETS.items():
        figure = summary[key]
        if figure is None:
            met = False
        elif kind == "max":
            met = figure <= target
        elif kind == "min":
            met = figure >= target
        else:
            met = target[0] <= figure <= target[1]
        found[key] = {"met": met, "figure": figure, "target": target, "kind": kind}
        if key in STEP_ERRORS and rough is not None:
            found[key]["target_below_roughness"] = target < rough
    return found


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def report(result: dict) -> None:
    """The figures and verdicts, as the closing lines of a run."""
    print(f"sync mapping: {result['sync_mapping']}; summary mode: {result['summary_mode']}")
    print(f"warm-up and epoch-end terms: {result['run_overheads']}")
    print(f"traces' roughness (vs batch neighbours), median: {_pct(result['roughness']['median'])}")
    noise = result["noise"]
    print(
        f"every profile read with noise {_pct(noise['sigma'])} ({noise['of']}); figures averaged over "
        f"{noise['seeds']} seeds"
    )
    for key, v in result["verdicts"].items():
        target = v["target"]
        shown = f"{target[0]:.0%}-{target[1]:.0%}" if isinstance(target, tuple) else f"{target:.0%}"
        print(
            f"  {key:24s} {_pct(v['figure']):>8s}  target {v['kind']} {shown:>8s}  {'met' if v['met'] else 'NOT met'}"
        )
    print("each GPUs-per-node g alone, pooled:")
    _report_modes(result["by_mode"])
    if result["node_shapes"]:
        print("GPUs per node a choice too (every traced g in one grid per model):")
        _report_modes(result["node_shapes"])


def _report_modes(by_mode: dict) -> None:
    for mode, figures in by_mode.items():
        worst = figures["max_error"]
        where = "" if worst is None else f" at {worst['model']} g={worst['gpus_per_node']} N={worst['nodes']}"
        where += "" if worst is None else f" B={worst['batch']}"
        print(
            f"  {mode:9s} unprofiled median {_pct(figures['median_error'])}, max {_pct(worst and worst['error'])}"
            f"{where}; leave-one-out median {_pct(figures['loo_median_error'])}; 1-sigma "
            f"{_pct(figures['sigma1_coverage'])}; time regret mean {_pct(figures['time_regret_mean'])} max "
            f"{_pct(figures['time_regret_max'])} (same g as the best {_pct(figures['time_same_gpus_per_node_share'])});"
            f" cost regret mean {_pct(figures['cost_regret_mean'])} max {_pct(figures['cost_regret_max'])} (same g "
            f"{_pct(figures['cost_same_gpus_per_node_share'])}); knee same {_pct(figures['knee_same_share'])}; "
            f"{figures['confirming_profiles_mean']:.1f} confirming profiles a job, the search "
            f"{_pct(figures['profile_cost_share'])} of the grid's device-seconds (largest "
            f"{_pct(figures['profile_cost_share_max'])}); ties {_pct(figures['tied_share'])}"
        )
