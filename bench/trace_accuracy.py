"""Benchmark: today's performance model on published GPU step times, replayed through the real stages (issue 25).

Why: every other figure of the model comes from CPU processes whose noise is as large as the model's error. The
Pollux artifact's traces (bench/data/pollux/README.md: 16 nodes x 4 T4 GPUs, ResNet18 on CIFAR-10 and ResNet50 on
ImageNet) are real GPU clusters: NCCL inside and across nodes, sync that backward hides.

Replay, per model folder under --traces and per GPUs-per-node g found in homogeneous placements (every node with
g GPUs: placements.csv rows whose digits are all g, and scalability.csv rows with num_replicas = num_nodes x g):
- job: bench_job with resources.gpus_per_node g, launcher slurm (nodes are real hosts, g ranks on each),
  train.epochs and node-hour pricing from the trace;
- candidates: every traced (N, b) of that g, B = N x g x b, in the shape plan.candidate_grid returns
  ({"nodes", "batch", "per_device_batch"}), none above the training set (the plan's rule). They are built here,
  not by candidate_grid: its grid doubles N and B from their minima, and the traces hold N in {1, 2, 3, 4, 6, 8,
  12, 16} and per-device batches a factor sqrt(2) apart (32, 45, 64, 91, ...), which it cannot express;
- which candidates are profiled: search.planned (partial, full) and search.adaptive_search (adaptive), the
  job's own settings (partial_second_batch, adaptive tolerance);
- a "profile" is read from the trace row instead of measured (`trace_profile`), with the keys profiling writes;
- fit, predict, T and cost: perfmodel.fit_and_predict; choice: selection.select. No second implementation.

Sync mapping (--sync-mapping, default "exposed"): step_time excludes data loading, so data_s = 0; sync_time is the
all-reduce left after backward ends, so compute_s = step_time - sync_time (forward, backward and the update:
update_s = 0, the fit adds it to compute anyway) and step_s = step_time. "exposed": sync_s = sync_time, the exposed
part, so the model's sync is the exposed sync and its overlap g should come out near 1. "largest": sync_s = the
largest sync_time traced at that N (and g), where backward hides least: a stand-in for the whole collective,
leaving the overlap g to say how the exposed part shrinks as the batch grows. Neither is the split the profile
stage measures (sync alone after a barrier), which the traces do not hold.

Truth: T = epochs x steps per epoch (layout.steps_per_epoch of train_samples, N x g ranks, b) x step_time, an
epoch's last, smaller step counted whole (the trace has no step at its batch; predict_candidates counts it
smaller, which favours large B where an epoch has few steps); cost by node-hours (pricing.costs).
Figures, pooled over models and g:
- partial_*: |predicted / true step - 1| on the candidates partial search did not profile, the largest named;
- full_loo_median_error: performance.leave_one_out over all candidates (as fit_and_predict computes it);
- regrets: true T (cost) of the configuration select chooses on the prediction over the true best's, minus 1,
  with objective.max_nodes none, 4 and 8; knee: the knee's global batch (selection's knee functions, the knee
  method the job uses) on the prediction equal to the one on the true curve;
- sigma1_coverage: share of the unprofiled candidates' real errors within their predicted rel_uncertainty;
- roughness: each traced step against the geometric mean of its two batch-axis neighbours (same N, g), median:
  what no smooth model can beat.
Summary figures are of the job's default search mode (search.mode in config/jobs.yaml: partial) except
full_loo_median_error; every mode's pooled figures are in `by_mode`, each (model, g) replay in `details`.

Run:  .venv/bin/python bench/trace_accuracy.py [--traces DIR] [--out FILE]   (seconds; CPU only, no torch work)
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import yaml
from common import REPO, bench_job, bench_parser, provenance

from tula_hpc.files import write_json

TRACES = REPO / "bench" / "data" / "pollux"
MODES = ("partial", "full", "adaptive")
MAX_NODES = (None, 4, 8)
SYNC_MAPPINGS = ("latent", "exposed", "largest")  # see the module's docstring; the first is the default
# Node-hour pricing reads no memory.json; pricing.costs prices every pricing model at once (as perf_accuracy.py).
NO_MEMORY = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}
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
}
STEP_ERRORS = ("partial_median_error", "partial_max_error", "full_loo_median_error")


def _homogeneous(placement: str) -> tuple[int, int] | None:
    """(nodes, GPUs per node) of a placement with the same GPU count on every node, else None."""
    return (len(placement), int(placement[0])) if len(set(placement)) == 1 and placement[0] != "0" else None


def read_trace(folder: Path) -> dict:
    """trace.yaml and the homogeneous points: {g: {(nodes, b): (step_time, sync_time)}}; placements.csv first."""
    meta = yaml.safe_load((folder / "trace.yaml").read_text())
    points: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}

    def add(nodes: int, g: int, row: dict) -> None:
        key = (nodes, int(row["local_bsz"]))
        points.setdefault(g, {}).setdefault(key, (float(row["step_time"]), float(row["sync_time"])))

    with open(folder / "placements.csv") as f:
        for row in csv.DictReader(f):
            shape = _homogeneous(row["placement"].strip())
            if shape:
                add(*shape, row)
    scalability = folder / "scalability.csv"
    if scalability.exists():
        with open(scalability) as f:
            for row in csv.DictReader(f):
                nodes, replicas = int(row["num_nodes"]), int(row["num_replicas"])
                if replicas % nodes == 0:
                    add(nodes, replicas // nodes, row)
    return {"name": folder.name, "meta": meta, "points": dict(sorted(points.items()))}


def trace_job(name: str, g: int, meta: dict, nodes: list[int]) -> dict:
    """The bench job the replay stands in for: g GPUs per node on a Slurm cluster, the trace's epochs, node-hours."""
    return bench_job(
        as_name=f"trace-{name}-g{g}",
        launcher="slurm",
        resources={"gpus_per_node": g, "mem_gb": 4 * g},
        train={"epochs": int(meta["epochs"]), "lr_milestones": []},  # the schedule is not replayed
        search={"nodes": {"min": min(nodes), "max": max(nodes)}},
        objective={"pricing": "node_hour"},
    )


def trace_candidates(points: dict, g: int, train_samples: int) -> list[dict]:
    """Every traced (N, b) as a plan candidate (candidate_grid's shape), none above the training set."""
    grid = [{"nodes": n, "batch": n * g * b, "per_device_batch": b} for n, b in sorted(points)]
    return [c for c in grid if c["batch"] <= train_samples]


def sync_split(points: dict, mapping: str) -> dict[tuple[int, int], tuple[float, float, float]]:
    """(nodes, b) -> (step_s, compute_s, sync_s) under the sync mapping (see the module's docstring)."""
    if mapping not in SYNC_MAPPINGS:
        raise ValueError(f"unknown sync mapping {mapping!r}; allowed: {', '.join(SYNC_MAPPINGS)}")
    largest: dict[int, float] = {}
    for (nodes, _), (_, sync) in points.items():
        largest[nodes] = max(largest.get(nodes, 0.0), sync)
    return {
        (nodes, b): (step, step - sync, {"latent": None, "exposed": sync, "largest": largest[nodes]}[mapping])
        for (nodes, b), (step, sync) in points.items()
    }


def trace_profile(candidate: dict, job: dict, split: tuple[float, float, float], grad_bytes: float) -> dict:
    """A profile record (profiling.measure's keys, plus what profile_one adds) read from a trace row."""
    from tula_hpc.layout import devices_per_node, ranks_per_host

    devices, nodes, b = devices_per_node(job), candidate["nodes"], candidate["per_device_batch"]
    step, compute, sync = split
    parts = {"data_s": 0.0, "compute_s": compute, "update_s": 0.0, "step_s": step}
    if sync is not None:
        parts["sync_s"] = sync
    return {
        "nodes": nodes,
        "world_size": nodes * devices,
        "ranks_per_host": ranks_per_host(job["launcher"], nodes, devices),
        "per_device_batch": b,
        "global_batch": candidate["batch"],
        "steps": 1,
        "median": parts,
        "iqr_over_median": dict.fromkeys(parts, 0.0),
        "samples_per_s": candidate["batch"] / step,
        "grad_bytes": grad_bytes,
        "measure_wall_s": step,
        "interference": 0.0,
    }


def true_candidates(job: dict, candidates: list[dict], steps: dict, train_samples: int) -> list[dict]:
    """Candidates with their true T and cost: T = epochs x steps per epoch x traced step."""
    from tula_hpc.layout import devices_per_node, steps_per_epoch
    from tula_hpc.pricing import costs

    devices, objective = devices_per_node(job), job["objective"]
    rows = []
    for c in candidates:
        ranks, b = c["nodes"] * devices, c["per_device_batch"]
        total = job["train"]["epochs"] * steps_per_epoch(train_samples, ranks, b) * steps[(c["nodes"], b)]
        price = costs(total, c["nodes"], ranks, b, objective, NO_MEMORY, None)
        rows.append({**c, "step_s": steps[(c["nodes"], b)], "time_s": total, "cost": price[objective["pricing"]]})
        rows[-1]["rel_uncertainty"] = 0.0
    return rows


def _key(c: dict) -> tuple[int, int]:
    return c["nodes"], c["batch"]


def choices(predicted: list[dict], truth: list[dict], objective: dict) -> list[dict]:
    """Per max_nodes: time and cost regret of select's choice on the prediction, and the knee against the true knee."""
    from tula_hpc.selection import select

    true_of = {_key(c): c for c in truth}
    found = []
    for max_nodes in MAX_NODES:
        case = {"max_nodes": max_nodes}
        for goal, field in (("time", "time_s"), ("cost", "cost")):
            wanted = {**objective, "max_nodes": max_nodes, "minimize": goal}
            chosen = select({"candidates": predicted, "pricing": objective["pricing"]}, wanted)["chosen"]
            best = select({"candidates": truth, "pricing": objective["pricing"]}, wanted)["chosen"]
            case[f"{goal}_regret"] = true_of[_key(chosen)][field] / best[field] - 1
            case[f"{goal}_chosen"] = {"nodes": chosen["nodes"], "batch": chosen["batch"]}
            case[f"{goal}_best"] = {"nodes": best["nodes"], "batch": best["batch"]}
        wanted = {**objective, "max_nodes": max_nodes, "minimize": "knee"}
        knee_p = select({"candidates": predicted, "pricing": objective["pricing"]}, wanted)
        knee_t = select({"candidates": truth, "pricing": objective["pricing"]}, wanted)
        case["knee_batch"] = knee_p["knees"][knee_p["knee_used"]]
        case["true_knee_batch"] = knee_t["knees"][knee_t["knee_used"]]
        case["knee_same"] = case["knee_batch"] == case["true_knee_batch"]
        found.append(case)
    return found


def searched(job: dict, candidates: list[dict], measure) -> dict[str, tuple[list[dict], dict, dict | None]]:
    """Per mode: the candidates it profiles, the fit settings, and adaptive search's record (search.py decides)."""
    from tula_hpc.layout import devices_per_node
    from tula_hpc.performance import candidate_row, model_params
    from tula_hpc.search import adaptive_search, planned

    devices, launcher, search = devices_per_node(job), job["launcher"], job["search"]
    settings = model_params(job)
    used = {
        mode: (planned(mode, candidates, devices, launcher, search["partial_second_batch"]), settings, None)
        for mode in ("partial", "full")
    }
    adaptive = adaptive_search(
        candidates,
        planned("adaptive", candidates, devices, launcher, search["partial_second_batch"]),
        measure,
        lambda c: candidate_row(c, devices, launcher),
        settings,
        search["adaptive"]["tolerance"],
        search["adaptive"]["max_profiles"],
    )
    record = {
        "profiled": len(adaptive["profiled"]),
        "added": len(adaptive["history"]),
        "stopped": adaptive["stopped"],
        "discrepancy_per_octave": adaptive["discrepancy_per_octave"],
        "history": adaptive["history"],
    }
    fitted = {**settings, "discrepancy_per_octave": adaptive["discrepancy_per_octave"]}
    used["adaptive"] = (adaptive["profiled"], fitted, record)
    return used


def replay(trace: dict, g: int, mapping: str = SYNC_MAPPINGS[0]) -> dict:
    """One model at g GPUs per node: every search mode's errors, coverage, regrets and knees against the trace."""
    from tula_hpc.perfmodel import fit_and_predict

    name, meta, points = trace["name"], trace["meta"], trace["points"][g]
    train_samples = int(meta["train_samples"])
    grad_bytes = float(meta["parameters"]) * float(meta["bytes_per_parameter"])
    job = trace_job(name, g, meta, sorted({n for n, _ in points}))
    candidates = trace_candidates(points, g, train_samples)
    steps = {key: step for key, (step, _) in points.items()}
    split = sync_split(points, mapping)

    def measure(c: dict) -> dict:
        """The trace row stands in for a profile job."""
        return trace_profile(c, job, split[(c["nodes"], c["per_device_batch"])], grad_bytes)

    truth = true_candidates(job, candidates, steps, train_samples)
    result = {"model": name, "gpus_per_node": g, "candidates": len(candidates), "modes": {}}
    for mode, (profiled, settings, record) in searched(job, candidates, measure).items():
        model, loo, weight, rows = fit_and_predict(
            job, [measure(c) for c in profiled], candidates, train_samples, NO_MEMORY, settings
        )
        chosen = {_key(c) for c in profiled}
        errors = [
            {
                "model": name,
                "gpus_per_node": g,
                "nodes": r["nodes"],
                "batch": r["batch"],
                "per_device_batch": r["per_device_batch"],
                "error": abs(r["step_s"] / steps[(r["nodes"], r["per_device_batch"])] - 1),
                "rel_uncertainty": r["rel_uncertainty"],
            }
            for r in rows
            if _key(r) not in chosen
        ]
        result["modes"][mode] = {
            "profiled": [{"nodes": c["nodes"], "batch": c["batch"]} for c in profiled],
            "params": model.params(),
            "notes": model.notes_,
            "leave_one_out": loo,
            "measurement_weight": weight,
            "errors": errors,
            "choices": choices(rows, truth, job["objective"]),
            "adaptive": record,
        }
    result["roughness"] = roughness(points, name, g)
    return result


def roughness(points: dict, name: str, g: int) -> list[dict]:
    """Each traced step against the geometric mean of its batch-axis neighbours (same N and g)."""
    found = []
    for nodes in sorted({n for n, _ in points}):
        batches = sorted(b for n, b in points if n == nodes)
        for low, mid, high in zip(batches, batches[1:], batches[2:]):
            neighbours = math.sqrt(points[(nodes, low)][0] * points[(nodes, high)][0])
            deviation = abs(points[(nodes, mid)][0] / neighbours - 1)
            found.append(
                {"model": name, "gpus_per_node": g, "nodes": nodes, "per_device_batch": mid, "error": deviation}
            )
    return found


def _largest(items: list[dict], key: str) -> dict | None:
    return max(items, key=lambda item: item[key]) if items else None


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def mode_figures(cases: list[dict], mode: str) -> dict:
    """One search mode's figures pooled over the replayed (model, g) cases."""
    errors = [e for case in cases for e in case["modes"][mode]["errors"]]
    picks = [
        dict(p, model=c["model"], gpus_per_node=c["gpus_per_node"]) for c in cases for p in c["modes"][mode]["choices"]
    ]
    regrets = {goal: [p[f"{goal}_regret"] for p in picks] for goal in ("time", "cost")}
    figures = {
        "unprofiled": len(errors),
        "median_error": _median([e["error"] for e in errors]),
        "max_error": _largest(errors, "error"),
        "sigma1_coverage": (sum(e["error"] <= e["rel_uncertainty"] for e in errors) / len(errors)) if errors else None,
        "median_rel_uncertainty": _median([e["rel_uncertainty"] for e in errors]),
        "loo_median_error": _median([x for case in cases for x in case["modes"][mode]["leave_one_out"]]),
        "loo_count": sum(len(case["modes"][mode]["leave_one_out"]) for case in cases),
        "knee_same_share": sum(p["knee_same"] for p in picks) / len(picks),
        "worst_time_regret": _largest(picks, "time_regret"),
        "worst_cost_regret": _largest(picks, "cost_regret"),
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
    """The summary object (fractions): `mode`'s figures, and full search's leave-one-out median."""
    chosen, full = mode_figures(cases, mode), mode_figures(cases, "full")
    return {
        "partial_median_error": mode_figures(cases, "partial")["median_error"],
        "partial_max_error": mode_figures(cases, "partial")["max_error"]["error"],
        "full_loo_median_error": full["loo_median_error"],
        "time_regret_mean": chosen["time_regret_mean"],
        "time_regret_max": chosen["time_regret_max"],
        "cost_regret_mean": chosen["cost_regret_mean"],
        "cost_regret_max": chosen["cost_regret_max"],
        "knee_same_share": chosen["knee_same_share"],
        "sigma1_coverage": chosen["sigma1_coverage"],
    }


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


def run(traces: Path, mapping: str = SYNC_MAPPINGS[0]) -> dict:
    """Replay every model folder under `traces` at every homogeneous g; the result file's contents."""
    folders = sorted(p.parent for p in traces.glob("*/trace.yaml"))
    if not folders:
        raise SystemExit(f"{traces}: no <model>/trace.yaml folders to replay")
    loaded = [read_trace(folder) for folder in folders]
    cases = [replay(trace, g, mapping) for trace in loaded for g in trace["points"]]
    default_mode = bench_job()["search"]["mode"]
    rough = [r for case in cases for r in case["roughness"]]
    rough_median = _median([r["error"] for r in rough])
    summary = summarise(cases, default_mode)
    return {
        "summary": summary,
        "verdicts": verdicts(summary, rough_median),
        "roughness": {"median": rough_median, "count": len(rough), "max": _largest(rough, "error")},
        "partial_largest_error": mode_figures(cases, "partial")["max_error"],
        "summary_mode": default_mode,
        "sync_mapping": mapping,
        "provenance": provenance(),
        "settings": {
            "traces": str(traces),
            "models": {t["name"]: t["meta"] for t in loaded},
            "gpus_per_node": {t["name"]: list(t["points"]) for t in loaded},
            "max_nodes": list(MAX_NODES),
            "targets": TARGETS,
        },
        "by_mode": {mode: mode_figures(cases, mode) for mode in MODES},
        "details": cases,
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def report(result: dict) -> None:
    """The figures and verdicts, as the closing lines of a run."""
    print(f"sync mapping: {result['sync_mapping']}; summary mode: {result['summary_mode']}")
    print(f"traces' roughness (vs batch neighbours), median: {_pct(result['roughness']['median'])}")
    for key, v in result["verdicts"].items():
        target = v["target"]
        shown = f"{target[0]:.0%}-{target[1]:.0%}" if isinstance(target, tuple) else f"{target:.0%}"
        print(
            f"  {key:24s} {_pct(v['figure']):>8s}  target {v['kind']} {shown:>8s}  {'met' if v['met'] else 'NOT met'}"
        )
    for mode, figures in result["by_mode"].items():
        worst = figures["max_error"]
        where = "" if worst is None else f" at {worst['model']} g={worst['gpus_per_node']} N={worst['nodes']}"
        where += "" if worst is None else f" B={worst['batch']}"
        print(
            f"  {mode:9s} unprofiled median {_pct(figures['median_error'])}, max {_pct(worst and worst['error'])}"
            f"{where}; leave-one-out median {_pct(figures['loo_median_error'])}; 1-sigma "
            f"{_pct(figures['sigma1_coverage'])}; time regret mean {_pct(figures['time_regret_mean'])} max "
            f"{_pct(figures['time_regret_max'])}; cost regret mean {_pct(figures['cost_regret_mean'])} max "
            f"{_pct(figures['cost_regret_max'])}; knee same {_pct(figures['knee_same_share'])}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "trace_accuracy.json")
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of <model>/ traces (default %(default)s)")
    parser.add_argument("--sync-mapping", choices=SYNC_MAPPINGS, default=SYNC_MAPPINGS[0], help="see the docstring")
    args = parser.parse_args(argv)
    result = run(args.traces, args.sync_mapping)
    write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)
    report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
