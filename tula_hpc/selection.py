"""Stage `select`: the configuration that minimises time, cost, or sits at the knee of time vs batch.

Two knees are reported. Kneedle (kneed, as in the paper) on the best time per global batch; it
normalises both axes, so for t(B) = a/B + c its answer depends only on the sampled range of B. The
model-based knee is the smallest B after which doubling B saves less than `min_saving` of the time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kneed import KneeLocator

from .files import read_json, write_json
from .stage import StageError, stage_main

RUNNERS_UP = 5
MIN_SAVING = 0.10


def best_time_per_batch(candidates: list[dict]) -> list[dict]:
    best: dict[int, dict] = {}
    for c in candidates:
        if c["batch"] not in best or c["time_s"] < best[c["batch"]]["time_s"]:
            best[c["batch"]] = c
    return [best[b] for b in sorted(best)]


def kneedle_knee(curve: list[dict]) -> int | None:
    if len(curve) < 3:
        return None
    knee = KneeLocator([c["batch"] for c in curve], [c["time_s"] for c in curve], curve="convex", direction="decreasing").knee
    return None if knee is None else int(knee)


def model_knee(curve: list[dict], min_saving: float = MIN_SAVING) -> int:
    """Smallest batch from which every further doubling saves less than `min_saving` of the time."""
    for i, c in enumerate(curve):
        later = curve[i + 1:]
        if all((prev["time_s"] - nxt["time_s"]) / prev["time_s"] < min_saving for prev, nxt in zip([c] + later, later)):
            return c["batch"]
    return curve[-1]["batch"]


def select(perfmodel: dict, objective: str) -> dict:
    candidates = perfmodel["candidates"]
    if not candidates:
        raise StageError("perfmodel.json has no candidates to choose from")
    curve = best_time_per_batch(candidates)
    knees = {"kneedle": kneedle_knee(curve), "model": model_knee(curve)}
    if objective == "time":
        ranked = sorted(candidates, key=lambda c: (c["time_s"], c["cost"]))
    elif objective == "cost":
        ranked = sorted(candidates, key=lambda c: (c["cost"], c["time_s"]))
    else:
        knee_batch = knees["kneedle"] if knees["kneedle"] is not None else knees["model"]
        at_knee = [c for c in curve if c["batch"] == knee_batch]
        ranked = at_knee + sorted((c for c in candidates if c not in at_knee), key=lambda c: abs(c["batch"] - knee_batch) + c["time_s"] * 1e-9)
    return {"objective": objective, "chosen": ranked[0], "knees": knees, "runners_up": ranked[1:1 + RUNNERS_UP],
            "best_time_curve": [{"batch": c["batch"], "nodes": c["nodes"], "time_s": c["time_s"]} for c in curve]}


def run_select(job: dict, perfmodel_path: Path, out: Path) -> dict:
    result = {"job": job["name"], **select(read_json(perfmodel_path), job["objective"]["minimize"])}
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--perfmodel", required=True, type=Path)
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/selection.json")

    return stage_main("select", add_args, lambda job, args: run_select(job, args.perfmodel, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
