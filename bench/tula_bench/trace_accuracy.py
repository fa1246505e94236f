"""Benchmark: the performance model on published GPU step times, replayed through the real stages (issue 25).

Why: every other figure of the model comes from CPU processes whose noise is as large as the model's error. The
Pollux artifact's traces (bench/data/pollux/README.md: 16 nodes x 4 T4 GPUs, ResNet18 on CIFAR-10 and ResNet50 on
ImageNet) are real GPU clusters: NCCL inside and across nodes, sync that backward hides.

Replay, per model folder under --traces, of the homogeneous placements (every node with the same g GPUs:
placements.csv rows whose digits are all g, and scalability.csv rows with num_replicas = num_nodes x g), twice:
each g alone (the figures below, pooled over models and g), and every traced g in one grid, GPUs per node being a
choice too (`node_shapes`):
- job: bench_job on launcher slurm (nodes are real hosts, g ranks on each) with search.gpus_per_node the g replayed
  and resources.gpus_per_node the largest, train.epochs and node-hour pricing from the trace; every other fit
  setting is the job's default for a GPU job (devices.FIT_DEFAULTS: the latent sync fit, the discrepancy prior);
- candidates: every traced (N, g, b), B = N x g x b, in the shape plan.candidate_grid returns ({"nodes",
  "gpus_per_node", "batch", "per_device_batch"}), none above the training set (the plan's rule). They are built
  here, not by candidate_grid: its grid doubles N and B from their minima, and the traces hold N in {1, 2, 3, 4,
  6, 8, 12, 16} and per-device batches a factor sqrt(2) apart (32, 45, 64, 91, ...), which it cannot express;
- which candidates are profiled: search.planned (partial, full) and search.adaptive_search (adaptive), the
  job's own settings (partial_second_batch, adaptive tolerance);
- a "profile" is read from the trace row instead of measured (`trace_profile`), with the keys profiling writes;
- fit, predict, T and cost: prediction.fit_and_predict; choice: choice.decide, confirmed by search.confirm_choice
  (each objective and max_nodes a job of its own), the truth's best by choice.select. No second implementation.

Sync mapping (--sync-mapping, default "latent"): step_time excludes data loading, so data_s = 0; sync_time is the
all-reduce left after backward ends, so compute_s = step_time - sync_time (forward, backward and the update:
update_s = 0, the fit adds it to compute anyway) and step_s = step_time. "latent": no sync part, as a profile of the
overlapped step alone; the model fits sync with the overlap g (search.sync_fit latent, the GPU default). For
comparison, with search.sync_fit split: "exposed": sync_s = sync_time, the exposed part; "largest": sync_s = the
largest sync_time traced at that N and g, where backward hides least, a stand-in for the whole collective that
the profile stage's split (sync alone after a barrier) measures and the traces do not hold.

Truth: T = epochs x ((steps per epoch - 1) x step_time + the last step's time), steps per epoch as
layout.steps_per_epoch cuts train_samples over N x g ranks at b, the last, smaller step (layout.last_batch) timed
by the trace at that N and g linearly between its traced batches (`traced_step`), as predict_candidates counts it
(an epoch of few large steps would otherwise be charged a whole step for a sliver of data); cost by node-hours
(pricing.costs). The traces hold step times only, no warm-up and no epoch end: the replay runs with W = c_epoch = 0
on both sides (fit-model's run_overhead terms are 0, and its notes say why) and says so (`RUN_OVERHEADS`).
Figures, pooled over models and g:
- partial_*: |predicted / true step - 1| on the candidates partial search did not profile, the largest named;
- full_loo_median_error: performance.leave_one_out over all candidates (as fit_and_predict computes it);
- regrets: true T (cost) of the configuration select chooses on the prediction over the true best's, minus 1,
  with objective.max_nodes none, 4 and 8; knee: the knee's global batch (selection's knee functions, the knee
  method the job uses) on the prediction equal to the one on the true curve; with g a choice, also the share of
  choices at the true best's g;
- sigma1_coverage: share of the unprofiled candidates' real errors within their predicted rel_uncertainty;
- roughness: each traced step against the geometric mean of its two batch-axis neighbours (same N, g), median:
  what no smooth model can beat.
Summary figures are of the job's default search mode (search.mode in config/jobs.yaml: partial) except
full_loo_median_error; every mode's pooled figures are in `by_mode` (`node_shapes` with g a choice), each replay in
`details` (`node_shape_details`). Settings chosen on these two models (the artifact's other models kept aside):
the latent fit, the second sync size at the middle, Cauchy's loss, the kink margin and the GPU discrepancy prior
(see the closing note of issue 25 and the constants' comments).

Run:  .venv/bin/python bench/trace_accuracy.py [--traces DIR] [--out FILE]   (about 9 min on 2 cores; CPU only)
      .venv/bin/python bench/trace_accuracy.py --smoke --out FILE   (seconds: one seed, each model on one node at its
      smallest g; CI's check that the replay runs end to end, its figures meaningless)
"""

from __future__ import annotations

import csv
import dataclasses
import math
import multiprocessing
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from tula_bench.common import REPO, bench_job, bench_parser, parse_bench_args, provenance, write_and_report
from tula_bench.trace_figures import (
    GOALS,
    TARGETS,
    largest_by,
    median_or_none,
    mode_figures,
    over_seeds,
    report,
    summarise,
    verdicts,
)

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

TRACES = REPO / "bench" / "data" / "pollux"
MODES = ("partial", "full", "adaptive")
MAX_NODES = (None, 4, 8)
SEEDS = 5  # noise seeds the figures are averaged over
SYNC_MAPPINGS = ("latent", "exposed", "largest")  # see the module's docstring; the first is the default
# Node-hour pricing reads no memory.json; pricing.costs prices every pricing model at once (as perf_accuracy.py).
NO_MEMORY = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}


def _homogeneous(placement: str) -> tuple[int, int] | None:
    """(nodes, GPUs per node) of a placement with the same GPU count on every node, else None."""
    return (len(placement), int(placement[0])) if len(set(placement)) == 1 and placement[0] != "0" else None


def read_trace(folder: Path) -> dict:
    """trace.yaml and the homogeneous points {(nodes, g, b): (step_time, sync_time)}, placements.csv's first."""
    meta = yaml.safe_load((folder / "trace.yaml").read_text())
    points: dict[tuple[int, int, int], tuple[float, float]] = {}

    def add(nodes: int, g: int, row: dict) -> None:
        points.setdefault((nodes, g, int(row["local_bsz"])), (float(row["step_time"]), float(row["sync_time"])))

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
    gpus = sorted({g for _, g, _ in points})
    return {"name": folder.name, "meta": meta, "points": dict(sorted(points.items())), "gpus": gpus}


def trace_job(name: str, gpus: tuple[int, ...], meta: dict, nodes: list[int], mapping: str) -> Job:
    """The bench job the replay stands in for: GPUs per node a choice among `gpus` on a Slurm cluster, the trace's
    epochs, node-hours; the latent sync fit (the GPU default) unless a mapping gives the profiles a sync part."""
    search = {"nodes": {"min": min(nodes), "max": max(nodes)}, "gpus_per_node": {"min": min(gpus), "max": max(gpus)}}
    if mapping != "latent":
        search["sync_fit"] = "split"
    return bench_job(
        as_name=f"trace-{name}-g{'-'.join(map(str, gpus))}",
        launcher="slurm",
        resources={"gpus_per_node": max(gpus), "mem_gb": 4 * max(gpus)},
        # the schedule is not replayed; the recipe's batch breaks ties (choice.TIE_RULE)
        train={"epochs": int(meta["epochs"]), "lr_milestones": [], "lr_base_batch": int(meta["recipe_batch"])},
        search=search,
        objective={"pricing": "node_hour"},
    )


def trace_candidates(points: dict, train_samples: int) -> list[dict]:
    """Every traced (N, g, b) as a plan candidate (candidate_grid's shape), none above the training set."""
    grid = [{"nodes": n, "gpus_per_node": g, "batch": n * g * b, "per_device_batch": b} for n, g, b in sorted(points)]
    return [c for c in grid if c["batch"] <= train_samples]


def sync_split(points: dict, mapping: str) -> dict[tuple[int, int, int], tuple[float, float, float | None]]:
    """(nodes, g, b) -> (step_s, compute_s, sync_s) under the sync mapping (see the module's docstring)."""
    if mapping not in SYNC_MAPPINGS:
        raise ValueError(f"unknown sync mapping {mapping!r}; allowed: {', '.join(SYNC_MAPPINGS)}")
    largest: dict[tuple[int, int], float] = {}
    for (nodes, g, _), (_, sync) in points.items():
        largest[(nodes, g)] = max(largest.get((nodes, g), 0.0), sync)
    return {
        (n, g, b): (step, step - sync, {"latent": None, "exposed": sync, "largest": largest[(n, g)]}[mapping])
        for (n, g, b), (step, sync) in points.items()
    }


def _point(c: dict) -> tuple[int, int, int]:
    return c["nodes"], c["gpus_per_node"], c["per_device_batch"]


def noise_factor(seed: int, model: str, point: tuple[int, int, int], noise: float) -> float:
    """The multiplicative noise of one profile read: exp(noise x z), z standard normal drawn from (seed, model,
    point), so a configuration reads the same within a seed however often and in whatever order it is read."""
    if noise == 0.0:
        return 1.0
    z = np.random.default_rng([seed, zlib.crc32(model.encode()), *point]).standard_normal()
    return math.exp(noise * z)


def trace_profile(
    candidate: dict, job: Job, split: tuple[float, float, float | None], grad_bytes: float, factor: float = 1.0
) -> dict:
    """A profile record (step_timing.measure's keys, plus what profile_one adds) read from a trace row, every part
    times the read's noise `factor`; its measuring wall time is the job's warm-up and measured steps at that step."""
    from tula_hpc.core.run_layout import candidate_devices, ranks_per_host

    devices, nodes, b = candidate_devices(candidate, job), candidate["nodes"], candidate["per_device_batch"]
    step, compute, sync = (None if part is None else part * factor for part in split)
    parts = {"data_s": 0.0, "compute_s": compute, "update_s": 0.0, "step_s": step}
    if sync is not None:
        parts["sync_s"] = sync
    return {
        "nodes": nodes,
        "gpus_per_node": candidate["gpus_per_node"],
        "world_size": nodes * devices,
        "ranks_per_host": ranks_per_host(job.launcher, nodes, devices),
        "per_device_batch": b,
        "global_batch": candidate["batch"],
        "steps": 1,
        "median": parts,
        "iqr_over_median": dict.fromkeys(parts, 0.0),
        "samples_per_s": candidate["batch"] / step,
        "grad_bytes": grad_bytes,
        "measure_wall_s": (job.search.warmup_steps + job.search.steps) * step,
        "interference": 0.0,
    }


def traced_step(steps: dict, nodes: int, g: int, b: int) -> float:
    """The trace's step at N nodes of g GPUs and per-device batch b: traced, or linear in b between the traced
    batches of that shape (beyond them, along the nearest two): for an epoch's last, smaller step."""
    if (nodes, g, b) in steps:
        return steps[(nodes, g, b)]
    batches = sorted(k for n, h, k in steps if (n, h) == (nodes, g))
    low, high = (
        batches[:2]
        if b < batches[0]
        else batches[-2:]
        if b > batches[-1]
        else next((x, y) for x, y in zip(batches, batches[1:]) if x <= b <= y)
    )
    slope = (steps[(nodes, g, high)] - steps[(nodes, g, low)]) / (high - low)
    return max(steps[(nodes, g, low)] + slope * (b - low), 0.0)


def true_candidates(job: Job, candidates: list[dict], steps: dict, train_samples: int) -> list[dict]:
    """Candidates with their true T and cost: T = epochs x (the traced step for every step of an epoch but the
    last, and the trace at the last one's smaller batch for it), as predict_candidates counts an epoch."""
    from tula_hpc.core.run_layout import candidate_devices, last_batch, steps_per_epoch
    from tula_hpc.performance.pricing import costs

    objective = job.objective
    rows = []
    for c in candidates:
        ranks, b = c["nodes"] * candidate_devices(c, job), c["per_device_batch"]
        step = steps[_point(c)]
        last = traced_step(steps, c["nodes"], c["gpus_per_node"], last_batch(train_samples, ranks, b))
        total = job.train.epochs * ((steps_per_epoch(train_samples, ranks, b) - 1) * step + last)
        price = costs(total, c["nodes"], ranks, b, objective, NO_MEMORY, None)
        rows.append({**c, "ranks": ranks, "step_s": step, "time_s": total, "cost": price[objective.pricing]})
        rows[-1]["rel_uncertainty"] = 0.0  # known exactly: the truth's best is its figure's, no tie
    return rows


def _key(c: dict) -> tuple[int, int, int]:
    return c["nodes"], c["gpus_per_node"], c["batch"]


def _shape(c: dict) -> dict:
    return {"nodes": c["nodes"], "gpus_per_node": c["gpus_per_node"], "batch": c["batch"]}


def confirmed_choices(
    job: Job, initial: list[dict], measure, predict, truth: list[dict], constants: dict
) -> list[dict]:
    """Per max_nodes and goal, a job of its own: search.confirm_choice from the mode's profiles (its own confirming
    profiles, at most constants["confirm"]), then its time or cost regret against the true best (or its knee against
    the true knee), the profiles that confirmed it and what the search's profiles cost against the whole grid's."""
    from tula_hpc.performance.choice import decide, select
    from tula_hpc.performance.search_modes import confirm_choice, search_price

    true_of, recipe = {_key(c): c for c in truth}, job.train.lr_base_batch
    found = []
    for max_nodes in MAX_NODES:
        case: dict = {"max_nodes": max_nodes}
        for goal in GOALS:
            wanted = dataclasses.replace(job.objective, max_nodes=max_nodes, minimize=goal)
            result = confirm_choice(
                initial,
                measure,
                predict,
                lambda rows, wanted=wanted: decide(rows, wanted, recipe, constants["tie_sigmas"]),
                constants["confirm"],
                constants["band_sigmas"],
            )
            decision, best = result["decision"], select(truth, job.objective.pricing, wanted, recipe)
            chosen = decision["chosen"]
            if goal == "knee":
                case["knee_batch"] = decision["knees"][decision["knee_used"]]
                case["true_knee_batch"] = best["knees"][best["knee_used"]]
                case["knee_same"] = case["knee_batch"] == case["true_knee_batch"]
            else:
                field = "time_s" if goal == "time" else "cost"
                case[f"{goal}_regret"] = true_of[_key(chosen)][field] / best["chosen"][field] - 1
                case[f"{goal}_chosen"], case[f"{goal}_best"] = _shape(chosen), _shape(best["chosen"])
                case[f"{goal}_same_gpus_per_node"] = chosen["gpus_per_node"] == best["chosen"]["gpus_per_node"]
            case[f"{goal}_confirmed"] = [{**_shape(c), "role": c["role"]} for c in result["confirmed"]]
            case[f"{goal}_tied"] = decision["tie"] is not None
            case[f"{goal}_profile_cost_share"] = search_price(result["profiles"], truth)["share"]
        found.append(case)
    return found


def searched(
    job: Job, candidates: list[dict], measure, modes: tuple[str, ...] = MODES
) -> dict[str, tuple[list[dict], dict, dict | None]]:
    """Per mode: the candidates it profiles, the fit settings, and adaptive search's record (search.py decides)."""
    from tula_hpc.core.run_layout import candidate_devices, devices_per_node
    from tula_hpc.performance.fitting import candidate_row, model_params
    from tula_hpc.performance.search_modes import adaptive_search, planned

    devices, launcher, search = devices_per_node(job), job.launcher, job.search
    settings = model_params(job)
    used = {
        mode: (planned(mode, candidates, devices, launcher, search.partial_second_batch), settings, None)
        for mode in ("partial", "full")
        if mode in modes
    }
    if "adaptive" not in modes:
        return used
    adaptive = adaptive_search(
        candidates,
        planned("adaptive", candidates, devices, launcher, search.partial_second_batch),
        measure,
        lambda c: candidate_row(c, candidate_devices(c, job), launcher),
        settings,
        search.adaptive.tolerance,
        search.adaptive.max_profiles,
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


RUN_OVERHEADS = (
    "none: the traces hold step times only (no warm-up, no epoch end), so the warm-up W and c_epoch are 0 in the "
    "prediction and the truth alike; T counts steps"
)


def default_constants(job: Job) -> dict:
    """The constants the confirmation and the tie rule run with: the job's search.confirm, choice.py's bands."""
    from tula_hpc.performance.choice import CONFIRM_BAND_SIGMAS, TIE_SIGMAS

    return {"confirm": job.search.confirm, "band_sigmas": CONFIRM_BAND_SIGMAS, "tie_sigmas": TIE_SIGMAS}


def _profile_point(profile: dict) -> tuple[int, int, int]:
    return profile["nodes"], profile["gpus_per_node"], profile["per_device_batch"]


def replay(
    trace: dict,
    gpus: tuple[int, ...],
    mapping: str = SYNC_MAPPINGS[0],
    seed: int = 0,
    noise: float = 0.0,
    constants: dict | None = None,
    modes: tuple[str, ...] = MODES,
    fits: dict | None = None,
) -> dict:
    """One model over the node shapes of `gpus` GPUs per node (one value: that g alone; several: g a choice too),
    every profile read with the seed's noise: each search mode's errors, coverage, regrets and knees against the
    trace, each objective's choice confirmed by its own profiles (`constants` override default_constants). `fits`:
    fits already made, by model, reads and settings (the tuning replays the same profiles many times)."""
    from tula_hpc.performance.prediction import fit_and_predict

    name, meta = trace["name"], trace["meta"]
    points = {key: value for key, value in trace["points"].items() if key[1] in gpus}
    train_samples = int(meta["train_samples"])
    grad_bytes = float(meta["parameters"]) * float(meta["bytes_per_parameter"])
    job = trace_job(name, gpus, meta, sorted({n for n, _, _ in points}), mapping)
    candidates = trace_candidates(points, train_samples)
    steps = {key: step for key, (step, _) in points.items()}
    split = sync_split(points, mapping)
    constants = {**default_constants(job), **(constants or {})}
    fits = {} if fits is None else fits

    def measure(c: dict) -> dict:
        """The trace row, with the seed's noise, stands in for a profile job."""
        point = _point(c)
        return trace_profile(c, job, split[point], grad_bytes, noise_factor(seed, name, point, noise))

    def predict(profiles: list[dict], settings: dict) -> tuple:
        reads = frozenset(map(_profile_point, profiles))
        key = (name, mapping, noise, seed, gpus, repr(sorted(settings.items())), reads)
        if key not in fits:
            fits[key] = fit_and_predict(job, profiles, candidates, train_samples, NO_MEMORY, settings)
        return fits[key]

    truth = true_candidates(job, candidates, steps, train_samples)
    result = {"model": name, "gpus_per_node": list(gpus), "candidates": len(candidates), "modes": {}}
    for mode, (profiled, settings, record) in searched(job, candidates, measure, modes).items():
        profiles = [measure(c) for c in profiled]
        model, loo, weight, rows = predict(profiles, settings)
        chosen = {_key(c) for c in profiled}
        errors = [
            {
                "model": name,
                **_shape(r),
                "per_device_batch": r["per_device_batch"],
                "error": abs(r["step_s"] / steps[_point(r)] - 1),
                "rel_uncertainty": r["rel_uncertainty"],
            }
            for r in rows
            if _key(r) not in chosen
        ]
        result["modes"][mode] = {
            "profiled": [_shape(c) for c in profiled],
            "params": model.coefficients(),
            "notes": model.notes_,
            "leave_one_out": loo,
            "measurement_weight": weight,
            "errors": errors,
            "choices": confirmed_choices(
                job, profiles, measure, lambda found, settings=settings: predict(found, settings)[3], truth, constants
            ),
            "adaptive": record,
        }
    result["roughness"] = roughness(points, name)
    return result


def roughness(points: dict, name: str) -> list[dict]:
    """Each traced step against the geometric mean of its batch-axis neighbours (same N and g)."""
    found = []
    for nodes, g in sorted({(n, g) for n, g, _ in points}):
        batches = sorted(b for n, h, b in points if (n, h) == (nodes, g))
        for low, mid, high in zip(batches, batches[1:], batches[2:]):
            neighbours = math.sqrt(points[(nodes, g, low)][0] * points[(nodes, g, high)][0])
            deviation = abs(points[(nodes, g, mid)][0] / neighbours - 1)
            found.append(
                {"model": name, "gpus_per_node": g, "nodes": nodes, "per_device_batch": mid, "error": deviation}
            )
    return found


def replay_seed(loaded: list[dict], mapping: str, seed: int, noise: float, constants: dict | None = None) -> dict:
    """Every model at each of its g alone (`cases`) and, where it has several, with g a choice (`shapes`)."""
    cases = [replay(trace, (g,), mapping, seed, noise, constants) for trace in loaded for g in trace["gpus"]]
    shapes = [replay(trace, tuple(trace["gpus"]), mapping, seed, noise, constants) for trace in loaded]
    return {"cases": cases, "shapes": [case for case, trace in zip(shapes, loaded) if len(trace["gpus"]) > 1]}


def load_traces(traces: Path, smoke: bool = False) -> list[dict]:
    """Every model folder's trace; in a smoke run only its smallest case (`smallest_case`)."""
    folders = sorted(p.parent for p in traces.glob("*/trace.yaml"))
    if not folders:
        raise SystemExit(f"{traces}: no <model>/trace.yaml folders to replay")
    loaded = [read_trace(folder) for folder in folders]
    return [smallest_case(trace) for trace in loaded] if smoke else loaded


def smallest_case(trace: dict) -> dict:
    """The trace's points on one node at its smallest g: a smoke run replays them in seconds (the whole trace takes
    minutes, most of them in the full mode's fits over every candidate)."""
    g = trace["gpus"][0]
    return {**trace, "points": {key: v for key, v in trace["points"].items() if key[:2] == (1, g)}, "gpus": [g]}


def traces_roughness(loaded: list[dict]) -> list[dict]:
    """Every model's roughness at each of its g: what no smooth model can beat, and the profiles' noise."""
    return [
        r
        for trace in loaded
        for g in trace["gpus"]
        for r in roughness({k: v for k, v in trace["points"].items() if k[1] == g}, trace["name"])
    ]


def run(
    traces: Path,
    mapping: str = SYNC_MAPPINGS[0],
    seeds: int = SEEDS,
    noise: float | None = None,
    smoke: bool = False,
) -> dict:
    """Replay every model folder under `traces` at every homogeneous g, over `seeds` noise seeds at `noise` (None:
    the traces' own roughness, the median); the result file's contents. `smoke`: each model's smallest case only."""
    loaded = load_traces(traces, smoke)
    rough = traces_roughness(loaded)
    rough_median = median_or_none([r["error"] for r in rough])
    noise = rough_median if noise is None else noise
    with multiprocessing.Pool(min(seeds, os.cpu_count() or 1)) as pool:
        replays = pool.starmap(replay_seed, [(loaded, mapping, seed, noise) for seed in range(seeds)])
    default_mode = bench_job().search.mode
    summaries = [summarise(r["cases"], default_mode) for r in replays]
    summary = over_seeds(summaries)
    return {
        "summary": summary,
        "verdicts": verdicts(summary, rough_median),
        "summary_by_seed": summaries,
        "noise": {
            "seeds": seeds,
            "sigma": noise,
            "of": "the traces' roughness, the median" if noise == rough_median else "given",
        },
        "roughness": {"median": rough_median, "count": len(rough), "max": largest_by(rough, "error")},
        "partial_largest_error": over_seeds([mode_figures(r["cases"], "partial") for r in replays])["max_error"],
        "summary_mode": default_mode,
        "sync_mapping": mapping,
        "run_overheads": RUN_OVERHEADS,
        "provenance": provenance(),
        "settings": {
            "smoke": smoke,
            "traces": str(traces),
            "models": {t["name"]: t["meta"] for t in loaded},
            "gpus_per_node": {t["name"]: t["gpus"] for t in loaded},
            "max_nodes": list(MAX_NODES),
            "constants": default_constants(bench_job()),
            "targets": TARGETS,
        },
        "by_mode": {mode: over_seeds([mode_figures(r["cases"], mode) for r in replays]) for mode in MODES},
        "node_shapes": (
            {mode: over_seeds([mode_figures(r["shapes"], mode) for r in replays]) for mode in MODES}
            if replays[0]["shapes"]
            else None
        ),
        "details_seed": 0,
        "details": replays[0]["cases"],
        "node_shape_details": replays[0]["shapes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "trace_accuracy.json")
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of <model>/ traces (default %(default)s)")
    parser.add_argument("--sync-mapping", choices=SYNC_MAPPINGS, default=SYNC_MAPPINGS[0], help="see the docstring")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="noise seeds averaged over (default %(default)s)")
    parser.add_argument(
        "--noise", type=float, help="the profiles' relative noise (default: the traces' roughness, the median)"
    )
    parser.add_argument("--smoke", action="store_true", help="one seed, each model's smallest case (CI's check)")
    args = parse_bench_args(parser, argv)
    seeds = 1 if args.smoke else args.seeds
    result = run(args.traces, args.sync_mapping, seeds, args.noise, args.smoke)
    return write_and_report(args.out, result, report)
