"""The report's account of the search: the profiles adaptive search added, those that confirmed the choice, what the
search's profiles cost against profiling the whole grid, and a tie the choice broke."""

from __future__ import annotations

from tula_hpc.core.records import FitResult, Selection
from tula_hpc.core.run_layout import node_shape
from tula_hpc.reporting.figures import markdown_table

CONFIRM_COLUMNS = [
    ("N", "nodes", "d"),
    ("GPUs/node", "gpus_per_node", "d"),
    ("B", "batch", "d"),
    ("measured as", "role", "s"),
    ("sigmas behind the best", "sigmas_behind", ".2f"),
    ("predicted step (s)", "predicted_step_s", ".5f"),
    ("measured step (s)", "measured_step_s", ".5f"),
]


def _adaptive(search: dict) -> str:
    if not search["history"]:
        return ""
    return (
        "\nAdaptive search added, each time the least certain candidate (error = how far the model was off "
        f"before seeing it); stopped: {search['stopped']}.\n\n"
        + markdown_table(
            search["history"],
            [
                ("N", "nodes", "d"),
                ("B", "batch", "d"),
                ("uncertainty", "uncertainty", ".1%"),
                ("predicted step (s)", "predicted_step_s", ".5f"),
                ("measured step (s)", "measured_step_s", ".5f"),
                ("error", "rel_error", ".1%"),
            ],
        )
    )


def _confirmation(search: dict) -> str:
    confirm = search.get("confirm")
    if not confirm:
        return ""
    measured = (
        "\n" + markdown_table(confirm["profiles"], CONFIRM_COLUMNS)
        if confirm["profiles"]
        else " It measured nothing more: the predicted best was measured and no rival could still win.\n"
    )
    return (
        f"\nThe choice ({confirm['objective']}) was confirmed before it committed: the predicted best where "
        f"unmeasured, then each rival within {confirm['band_sigmas']:g} of their combined 1-sigma bands of it, the "
        f"likeliest first, at most {confirm['limit']} profiles (search.confirm); stopped: {confirm['stopped']}.\n"
        + measured
    )


def _price(search: dict) -> str:
    price = search.get("price")
    if not price or price["share"] is None:
        return ""
    return (
        f"\nThe search's profiles took {price['device_s']:.1f} device-seconds (ranks x measuring time), "
        f"{price['share']:.0%} of what profiling all candidates would take at the same steps "
        f"({price['grid_device_s']:.1f} device-seconds).\n"
    )


def search_section(perfmodel: FitResult) -> str:
    """The search's paragraphs of the performance-model section."""
    search = perfmodel.search
    return _adaptive(search) + _confirmation(search) + _price(search)


def tie_sentence(selection: Selection) -> str:
    """What the choice says where configurations tied with the best within the noise (with its leading space)."""
    tie = selection.tie
    if not tie:
        return ""
    tied = ", ".join(f"{node_shape(c)} B={c['batch']}" for c in tie["tied"])
    best = tie["best_by_figure"]
    return (
        f" Tied within the noise ({tie['tie_sigmas']:g} of their combined 1-sigma bands): {tied}; the figure alone "
        f"would take {node_shape(best)} B={best['batch']}. Rule: {tie['rule']}."
    )
