"""The report's choice section: the chosen configuration and why (objective, constraints, a tie, the noise scale's
progress, the cluster's limits and queue), both knees and the runners-up."""

from __future__ import annotations

from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.core.run_layout import node_shape
from tula_hpc.reporting.figures import GPUS_COLUMN, markdown_table
from tula_hpc.reporting.search_section import tie_sentence

RUNNER_UP_COLUMNS = [
    ("runner-up N", "nodes", "d"),
    *GPUS_COLUMN,
    ("B", "batch", "d"),
    ("T (s)", "time_s", ".2f"),
    ("cost", "cost", ".5g"),
]


def _constraints(selection: Selection) -> str:
    set_ = {k: v for k, v in selection.constraints.items() if v is not None}
    if not set_:
        return "No constraints."
    return (
        "Constraints: "
        + ", ".join(f"{k} = {v:g}" for k, v in set_.items())
        + f" ({selection.feasible} of {selection.candidates} candidates meet them)."
    )


def _progress(selection: Selection, perfmodel: FitResult) -> str:
    """Time per recipe against time to the recipe's progress, and why they differ (the noise scale)."""
    noise, chosen = perfmodel.noise_scale, selection.chosen
    if noise is None:
        return "No gradient noise scale was measured (no multi-rank profile): every batch is timed for train.epochs."
    ran = "its progress" if selection.predicted["to"] == "progress" else "train.epochs"
    return (
        f"At the gradient noise scale the profiles measured (B_noise = {noise['b_noise']:.3g}, median of "
        f"{noise['profiles']}), this batch makes the recipe's progress (train.epochs at train.lr_base_batch) in "
        f"{chosen['progress_epochs']:.1f} epochs, {chosen['progress_time_s']:.2f} s, cost "
        f"{chosen['progress_cost']:.5g}: "
        f"a batch far above B_noise needs more epochs for the same progress, one far below it no more steps "
        f"(the dash-dotted curve). Training runs to {ran}."
    )


def _cluster(plan: dict, selection: Selection, summary: TrainSummary) -> str:
    """What the partition left out of the grid, the wait Slurm estimated for the chosen train job (objective.queue
    estimate) and the wall time it asked for."""
    predicted, parts, partition = selection.predicted, [], plan.get("partition")
    if partition and partition["excluded"]:
        reasons = sorted({reason for c in partition["excluded"] for reason in c["breaks"]})
        parts.append(
            f"Partition {partition['partition']} left out {len(partition['excluded'])} candidates: "
            f"{'; '.join(reasons)}."
        )
    if "wait_s" in predicted:
        parts.append(
            f"Queue: a wait of {predicted['wait_s']:.0f} s before the {predicted['time_s']:.1f} s of training, "
            f"{predicted['result_time_s']:.1f} s to the result; the wait is Slurm's estimate at selection time "
            f"(sbatch --test-only), not a promise."
        )
    if summary.time_limit_min is not None:
        parts.append(f"The train job asked for a wall time of {summary.time_limit_min} min.")
    return " ".join(parts)


def choice_section(
    job: str, links: dict[str, str], plan: dict, perfmodel: FitResult, selection: Selection, summary: TrainSummary
) -> str:
    """The report's title and choice; `links` holds the plots' links relative to the report (keys as report.PLOTS)."""
    chosen, knees = selection.chosen, selection.knees
    return f"""# tula-hpc report: {job}

## Choice
**{node_shape(chosen)}, global batch {chosen["batch"]}** ({chosen["per_device_batch"]} per device), chosen to
minimise **{selection.objective}** ({selection.pricing} pricing). Predicted training time {chosen["time_s"]:.2f} s
(+-{chosen["rel_uncertainty"]:.0%}), cost {chosen["cost"]:.5g}. {_constraints(selection)}{tie_sentence(selection)}
{_progress(selection, perfmodel)} {_cluster(plan, selection, summary)}
Knees of the best-time-per-batch curve: Kneedle {knees["kneedle"]} (depends only on the sampled batch range),
model-based {knees["model"]} (from there each doubling saves less than {selection.knee_min_saving:.0%} of the time); the
knee objective used the {selection.knee_used or selection.knee_method} knee (asked for: `{selection.knee_method}`).

{markdown_table(selection.runners_up, RUNNER_UP_COLUMNS)}
![time vs batch]({links["time"]})

![cost surface]({links["cost"]})

"""
