"""The report's plots of the model and the choice: time vs global batch per node shape (N nodes x g GPUs; profiled
points, fitted curves with their uncertainty, both knees, the choice), the cost surface over (N x g, B), and predicted
vs measured step times (the training curves are training_section.py's)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.colors import LogNorm
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.core.run_layout import node_shape
from tula_hpc.reporting.figures import plt, save_png


def _shape(candidate: dict) -> tuple:
    """A candidate's node shape (nodes, GPUs per node): 4 x 1 and 2 x 2 share ranks but not the machines."""
    return candidate["nodes"], candidate.get("gpus_per_node")


def rows_by_shape(candidates: list[dict]) -> dict[tuple, list[dict]]:
    rows: dict[tuple, list[dict]] = {}
    for c in sorted(candidates, key=lambda c: (*_shape(c), c["batch"])):
        rows.setdefault(_shape(c), []).append(c)
    return rows


def _log_axis(ax, which: str, scale: float = 1.0) -> None:
    """Log scale with plain numbers at 1-2-5 steps, readable even when the data span less than a decade."""
    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value * scale:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_time_vs_batch(perfmodel: FitResult, selection: Selection, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for row in rows_by_shape(perfmodel.candidates).values():
        shape = node_shape(row[0], "N={}")
        (line,) = ax.plot(
            [c["batch"] for c in row], [c["time_s"] for c in row], marker=".", label=f"estimated, {shape}"
        )
        ax.fill_between(
            [c["batch"] for c in row],
            [c["time_s_range"][0] for c in row],
            [c["time_s_range"][1] for c in row],
            color=line.get_color(),
            alpha=0.15,
            linewidth=0,
        )
        # A profile's T: the candidate's predicted T scaled by how its measured step compares with the prediction.
        # The per-device batch tells the GPUs per node apart at the same N and B.
        predicted = {(c["nodes"], c["batch"], c["per_device_batch"]): c["time_s"] / c["step_s"] for c in row}
        at = [(p, (p["nodes"], p["batch"], p["per_device_batch"])) for p in perfmodel.profiled]
        measured = [(p, key) for p, key in at if key in predicted]
        ax.scatter(
            [p["batch"] for p, _ in measured],
            [p["measured_step_s"] * predicted[key] for p, key in measured],
            marker="x",
            s=60,
            color=line.get_color(),
            label=f"profiled, {shape}",
        )
    progress = [c for c in perfmodel.candidates if "progress_time_s" in c]
    if progress:  # the best shape's time to the recipe's progress at each batch (goodput's curve)
        best: dict[int, float] = {}
        for c in progress:
            best[c["batch"]] = min(best.get(c["batch"], math.inf), c["progress_time_s"])
        batches = sorted(best)
        ax.plot(batches, [best[b] for b in batches], color="black", linestyle="-.", label="to the recipe's progress")
    knees = selection.knees
    if knees["kneedle"] is not None:
        ax.axvline(knees["kneedle"], color="grey", linestyle="--", label=f"Kneedle knee B={knees['kneedle']}")
    ax.axvline(knees["model"], color="black", linestyle=":", label=f"model knee B={knees['model']}")
    chosen = selection.chosen
    ax.scatter(
        [chosen["batch"]],
        [chosen["time_s"]],
        s=220,
        facecolors="none",
        edgecolors="red",
        linewidths=2,
        label=f"chosen: {node_shape(chosen, 'N={}')}, B={chosen['batch']}",
        zorder=5,
    )
    ax.set(
        xlabel="global batch B",
        ylabel="training time T (s)",
        title=f"{perfmodel.job}: time vs batch ({selection.objective} objective)",
    )
    ax.set_xscale("log", base=2)
    _log_axis(ax, "y")
    ax.legend(fontsize=7)
    save_png(fig, out)


def plot_cost_surface(perfmodel: FitResult, selection: Selection, out: Path) -> None:
    rows = rows_by_shape(perfmodel.candidates)
    batches = sorted({c["batch"] for c in perfmodel.candidates})
    grid = [[math.nan] * len(batches) for _ in rows]
    for i, row in enumerate(rows.values()):
        for c in row:
            grid[i][batches.index(c["batch"])] = c["cost"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.8 * len(batches)), 1.8 + 0.6 * len(rows)))
    norm = LogNorm()
    image = ax.imshow(grid, cmap="viridis", norm=norm, aspect="auto", origin="lower")
    for i, row in enumerate(rows.values()):
        for c in row:
            dark = norm(c["cost"]) < 0.6  # viridis is dark at its low end
            ax.text(
                batches.index(c["batch"]),
                i,
                f"{c['cost']:.3g}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
            )
    chosen = selection.chosen
    ax.add_patch(
        plt.Rectangle(
            (batches.index(chosen["batch"]) - 0.5, list(rows).index(_shape(chosen)) - 0.5),
            1,
            1,
            fill=False,
            edgecolor="red",
            linewidth=2.5,
        )
    )
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(rows)), [node_shape(row[0], "{}") for row in rows.values()])
    ax.set(
        xlabel="global batch B",
        ylabel="nodes N (x GPUs per node)",
        title=f"predicted cost ({perfmodel.pricing} pricing); red: chosen",
    )
    fig.colorbar(image, ax=ax, label="cost")
    save_png(fig, out)


def plot_predicted_vs_measured(perfmodel: FitResult, summary: TrainSummary, selection: Selection, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    measured = [p["measured_step_s"] for p in perfmodel.profiled]
    predicted = [p["predicted_step_s"] for p in perfmodel.profiled]
    ax.scatter(measured, predicted, marker="x", label="profiled configurations")
    trained = summary.train_time_s / max(summary.steps, 1)
    ax.scatter([trained], [selection.chosen["step_s"]], marker="o", color="red", label="training run (mean step)")
    low, high = min(measured + predicted + [trained]) / 1.3, max(measured + predicted + [trained]) * 1.3
    ax.plot([low, high], [low, high], color="black", linewidth=1)
    ax.fill_between(
        [low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="grey", alpha=0.2, label="+-10 %"
    )
    ax.set(
        xlim=(low, high),
        ylim=(low, high),
        xlabel="measured step time (ms)",
        ylabel="predicted step time (ms)",
        title="predicted vs measured",
    )
    _log_axis(ax, "x", scale=1e3)
    _log_axis(ax, "y", scale=1e3)
    ax.legend(fontsize=7)
    save_png(fig, out)
