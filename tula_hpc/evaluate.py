"""Stage `evaluate`: test top-1 accuracy of the trained model, and measured vs predicted training time."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import launch
from .data import load_splits
from .distributed import init_distributed, shutdown
from .files import read_json, write_json
from .models import build_model
from .stage import stage_main
from .train import evaluate_accuracy


def evaluate_worker(job: dict, model_path: str) -> dict:
    ctx = init_distributed(job["resources"]["gpus_per_node"] > 0)
    saved = torch.load(model_path, map_location="cpu", weights_only=False)
    splits = load_splits(job["data"], job["train"]["seed"])
    model = build_model(saved["model_name"], saved["num_classes"], saved["in_channels"], saved["image_size"])
    model.load_state_dict(saved["model"])
    accuracy = evaluate_accuracy(model.to(ctx.device), splits.test, ctx)
    shutdown()
    return {"test_accuracy": accuracy, "test_samples": len(splits.test)}


def evaluate(job: dict, model_path: Path, summary_path: Path, selection_path: Path, out: Path, work_dir: Path) -> dict:
    summary, chosen = read_json(summary_path), read_json(selection_path)["chosen"]
    spec = launch.LaunchSpec.for_job(job, nodes=1)
    spec = launch.LaunchSpec(**{**spec.__dict__, "gpus_per_node": min(spec.gpus_per_node, 1)})
    scores = launch.run(evaluate_worker, dict(job=job, model_path=str(Path(model_path).resolve())), spec,
                        Path(work_dir) / "evaluate", name=f"{job['name']}-evaluate")
    measured, predicted = summary["train_time_s"], chosen["time_s"]
    result = {
        "job": job["name"], **scores, "nodes": chosen["nodes"], "global_batch": chosen["batch"],
        "measured_train_time_s": measured, "predicted_train_time_s": predicted,
        "time_rel_error": (predicted - measured) / measured,
        "measured_cost": measured / 3600 * chosen["nodes"] * job["objective"]["price_per_node_hour"],
        "predicted_cost": chosen["cost"], "wall_time_s": summary["wall_time_s"],
    }
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", required=True, type=Path, help="train/model.pt")
        parser.add_argument("--summary", required=True, type=Path, help="train/summary.json")
        parser.add_argument("--selection", required=True, type=Path)
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/eval.json")

    return stage_main("evaluate", add_args, lambda job, args: evaluate(
        job, args.model, args.summary, args.selection, args.out, args.work_dir), argv)


if __name__ == "__main__":
    raise SystemExit(main())
