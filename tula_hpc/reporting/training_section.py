"""The report's training section: the run's time beside its steps, the curves, AGS's view (Fig. 7) and the gradient
noise scale over training."""

from __future__ import annotations

from pathlib import Path

from tula_hpc.core.records import TrainSummary
from tula_hpc.reporting.figures import link, plt, save_png
from tula_hpc.reporting.task_words import TaskWords


def _versus(evaluation: dict, part: str) -> str:
    measured, predicted = evaluation.get(f"measured_{part}_epoch_s"), evaluation.get(f"predicted_{part}_epoch_s")
    if measured is None or predicted is None:
        return "not measured"
    return f"predicted {predicted:.3f} s, measured {measured:.3f} s ({evaluation[f'{part}_epoch_rel_error']:+.0%})"


def time_terms(chosen: dict, predicted: dict, evaluation: dict) -> str:
    """What the run spends once and per epoch beside its steps (performance/run_overhead.py), and the first and
    steady epochs predicted against measured (evaluate's comparison)."""
    first, second = chosen.get("warmup_first_s", 0.0), chosen.get("warmup_second_s", 0.0)
    return (
        f"Beside the steps: a warm-up of {first + second:.3f} s once ({first:.3f} s in the first epoch, {second:.3f} s "
        f"in the second), {chosen.get('epoch_start_s', 0.0):.3f} s at each later epoch's start (the loader's restart, "
        f"the strategy's once-per-epoch step), and outside the epochs {chosen.get('outside_epoch_s', 0.0):.3f} s at "
        f"each epoch's end (the strategy's epoch end, validation, the checkpoint): "
        f"{predicted.get('job_time_s', 0.0):.2f} s in all, what the Slurm wall time is set from. First epoch: "
        f"{_versus(evaluation, 'first')}; steady epochs: {_versus(evaluation, 'steady')}."
    )


def _plot_curves(curves, summary: TrainSummary, words: TaskWords) -> None:
    """The headline's validation score (as trained) and the training loss: per epoch, or per step where
    train.val_every_steps validated between epochs (records of kind validation)."""
    metric, history = words.headline, summary.epoch_history
    by_step = len(history) < len(summary.history)
    x = "step" if by_step else "epoch"
    validated = [r for r in summary.history if f"val_{metric}" in r] if by_step else history
    name = metric.replace("_", " ")
    curves.plot(
        [r[x] for r in validated], [r[f"val_{metric}"] for r in validated], marker=".", label=f"validation {name}"
    )
    curves.set(xlabel=x, ylabel=f"validation {name} (as trained)", title=f"training (`{summary.strategy}`)")
    if words.is_share(metric):
        curves.set(ylim=(0, 1.02))
    loss_axis = curves.twinx()
    loss_axis.plot([r[x] for r in history], [r["loss"] for r in history], color="grey", linestyle="--", label="loss")
    loss_axis.set(ylabel="training loss")


def strategy_section(summary: TrainSummary, plot: Path, report: Path, words: TaskWords | None = None) -> str:
    """The training curves in the task's words (`words`, eval.json's; None: an image job's); for ags/static also
    Fig. 7's view: scaled steps per epoch and the factor density.

    Writes `plot`; the section links to it relative to `report`.
    """
    strategy, history = summary.strategy, summary.epoch_history
    epochs = [r for r in history if "ags" in r]
    hist = epochs[-1]["ags"]["scale_hist"] if epochs else None
    noise = [(r["epoch"], r["noise_scale"]["b_noise"]) for r in history if (r["noise_scale"] or {}).get("b_noise")]
    panels = 1 + bool(epochs) + bool(hist) + bool(noise)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6), squeeze=False)
    _plot_curves(axes[0][0], summary, words or TaskWords.of({}))
    if epochs:
        axes[0][1].plot([r["epoch"] for r in epochs], [r["ags"]["scaled_fraction"] for r in epochs], marker=".")
        axes[0][1].set(
            xlabel="epoch",
            ylabel="fraction of steps scaled",
            ylim=(-0.05, 1.05),
            title="steps outside sensitive phases (Delta < delta)",
        )
    if hist:
        total = sum(hist["counts"])
        axes[0][2].stairs([c / total for c in hist["counts"]], hist["edges"], fill=True)
        axes[0][2].set(
            xscale="log",
            xlabel="scale factor s (s_min, 1, s_max)",
            ylabel="share of gradient entries",
            title=f"factors after epoch {epochs[-1]['epoch']}",
        )
        ticks = [hist["edges"][0], 1.0, hist["edges"][-1]]
        axes[0][2].set_xticks(ticks, labels=[f"{t:.3g}" for t in ticks])
        axes[0][2].minorticks_off()
    ran = [(r["epoch"], r["batch_schedule"]["ran"]["global_batch"]) for r in history if "batch_schedule" in r]
    if noise:
        _plot_noise_scale(axes[0][-1], noise, summary.global_batch, ran)
    save_png(fig, plot)
    figure = (
        f"\n\n![training]({link(plot, report)})\n{noise_scale_line(noise, summary.global_batch)}"
        f"{batch_schedule_line(history)}"
    )
    if not epochs:
        return f"\n## Training strategy\n`{strategy}`: no gradient scaling.{figure}"
    steps = sum(r["ags"]["steps"] for r in epochs)
    scaled = sum(r["ags"]["scaled_steps"] for r in epochs)
    medians = [r["ags"]["delta"]["median"] for r in epochs if r["ags"]["delta"]]
    delta = f"; median Delta per epoch from {min(medians):.3g} to {max(medians):.3g}" if medians else ""
    return (
        f"\n## Gradient scaling (`{strategy}`)\n{scaled} of {steps} steps ({scaled / steps:.0%}) were scaled, "
        f"{sum(r['ags']['gradscale_updates'] for r in epochs)} factor updates{delta}.{figure}"
    )


def _plot_noise_scale(ax, noise: list[tuple[int, float]], batch: int, ran: list[tuple[int, int]]) -> None:
    """B_noise per epoch beside the global batch: each epoch's under train.batch_schedule adaptive (`ran`), else the
    one trained throughout."""
    ax.plot([e for e, _ in noise], [b for _, b in noise], marker=".", label="B_noise")
    if ran:
        ax.plot([e for e, _ in ran], [b for _, b in ran], color="black", drawstyle="steps-mid", label="global batch")
    else:
        ax.axhline(batch, color="black", linestyle=":", label=f"trained batch {batch}")
    title = "batch and noise scale over training" if ran else "noise scale over training"
    ax.set(yscale="log", xlabel="epoch", ylabel="gradient noise scale B_noise", title=title)
    ax.legend(fontsize="small")


def batch_schedule_line(history: list[dict]) -> str:
    """train.batch_schedule adaptive's or ramp's changes of batch, each where it fell (after an epoch, or after a step
    mid-epoch) with the noise scale measured then (none fixed)."""
    schedule = [r for r in history if "batch_schedule" in r]
    if not schedule:
        return ""
    changes = [
        f"{r['batch_schedule']['ran']['global_batch']} -> {r['batch_schedule']['next']['global_batch']} "
        f"{_where(r)} (B_noise {r['batch_schedule']['b_noise'] or float('nan'):.3g})"
        for r in schedule
        if r["batch_schedule"]["next"]["global_batch"] != r["batch_schedule"]["ran"]["global_batch"]
    ]
    start = schedule[0]["batch_schedule"]["ran"]["global_batch"]
    if schedule[0]["batch_schedule"]["reason"] == "ramp":
        how = "`ramp` (doubled in equal stretches of the run's first samples up to the selected batch)"
    else:
        how = "`adaptive` (chosen again by goodput during the run from the noise scale measured so far, at the node "
        how += "shape held)"
    said = "; ".join(changes) if changes else "no change: the choice stayed at it"
    return f"\nBatch schedule {how}: started at {start}; {said}.\n"


def _where(record: dict) -> str:
    """Where a change of batch fell: after an epoch, or after an optimiser step mid-epoch."""
    return (
        f"after step {record['step']}" if record.get("kind") == "batch_schedule" else f"after epoch {record['epoch']}"
    )


def noise_scale_line(noise: list[tuple[int, float]], batch: int) -> str:
    """What the trained batch costs at the last measured noise scale, in one line (McCandlish et al., 2018)."""
    if not noise:
        return "\nNo gradient noise scale: it is measured by DDP's all-reduce, on two ranks or more (not polo).\n"
    epoch, b_noise = noise[-1]
    return (
        f"\nGradient noise scale at epoch {epoch}: B_noise = {b_noise:.3g}. At the trained batch B = {batch} a given "
        f"loss takes 1 + B / B_noise = {1 + batch / b_noise:.2f} times the samples a small batch needs, and "
        f"1 + B_noise / B = {1 + b_noise / batch:.2f} times the steps of an unboundedly large one.\n"
    )
