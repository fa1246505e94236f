"""Stage `report`: results/{job}/report.md and its plots, from every file the earlier stages wrote.

Plots: time vs global batch per node shape (N nodes x g GPUs; profiled points, fitted curves with their uncertainty,
both knees, the choice), the cost surface over (N x g, B), predicted vs measured step times, and the training curves.
Every file read and written is named on the command line, so the rule declares exactly what the stage touches. The
sections are reporting/'s (choice, outcome, memory model, performance model, training); the stage reads, assembles
and writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.atomic_files import read_json, write_text
from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.reporting.choice_section import choice_section
from tula_hpc.reporting.figures import link
from tula_hpc.reporting.memory_section import memory_section
from tula_hpc.reporting.model_section import model_section
from tula_hpc.reporting.outcome_section import outcome_section
from tula_hpc.reporting.plots import plot_cost_surface, plot_predicted_vs_measured, plot_time_vs_batch
from tula_hpc.reporting.task_words import TaskWords
from tula_hpc.reporting.training_section import strategy_section
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

INPUTS = ("memory", "plan", "perfmodel", "selection", "summary", "evaluation")
PLOTS = ("time", "cost", "accuracy", "training")


def render(
    job: str,
    links: dict[str, str],
    memory: dict,
    plan: dict,
    perfmodel: FitResult,
    selection: Selection,
    summary: TrainSummary,
    evaluation: dict,
) -> str:
    """The report's body, up to the training section (which draws its plot as it is written)."""
    return (
        choice_section(job, links, plan, perfmodel, selection, summary)
        + outcome_section(links, memory, selection, summary, evaluation)
        + memory_section(memory)
        + model_section(plan, perfmodel)
    )


def report(job: Job, inputs: dict[str, Path], out: Path, plots: dict[str, Path]) -> None:
    """Read the files in `inputs` (keys INPUTS), write `out` and the plots in `plots` (keys PLOTS), nothing else."""
    memory, plan, evaluation = (read_json(inputs[name]) for name in ("memory", "plan", "evaluation"))
    perfmodel, selection = FitResult.read(inputs["perfmodel"]), Selection.read(inputs["selection"])
    summary = TrainSummary.read(inputs["summary"])
    plot_time_vs_batch(perfmodel, selection, plots["time"])
    plot_cost_surface(perfmodel, selection, plots["cost"])
    plot_predicted_vs_measured(perfmodel, summary, selection, plots["accuracy"])
    scaling = strategy_section(summary, plots["training"], out, TaskWords.of(evaluation))
    links = {key: link(path, out) for key, path in plots.items()}
    write_text(out, render(job.name, links, memory, plan, perfmodel, selection, summary, evaluation) + scaling)


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        for flag, dest, example in [
            ("--memory", "memory", "memory.json"),
            ("--plan", "plan", "plan.json"),
            ("--perfmodel", "perfmodel", "perfmodel.json"),
            ("--selection", "selection", "selection.json"),
            ("--summary", "summary", "train/summary.json"),
            ("--eval", "evaluation", "eval.json"),
            ("--out", "out", "report.md"),
            ("--time-plot", "time", "time_vs_batch.png"),
            ("--cost-plot", "cost", "cost_surface.png"),
            ("--accuracy-plot", "accuracy", "predicted_vs_measured.png"),
            ("--training-plot", "training", "training.png"),
        ]:
            parser.add_argument(flag, dest=dest, required=True, type=Path, help=f"results/{{job}}/{example}")

    def run(job: Job, args: argparse.Namespace) -> None:
        inputs = {name: getattr(args, name) for name in INPUTS}
        report(job, inputs, args.out, {key: getattr(args, key) for key in PLOTS})

    return stage_main("report", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
