"""The report's figures: matplotlib without a display, PNGs written atomically, links relative to the report, and
markdown tables."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tula_hpc.core.atomic_files import atomic_path  # noqa: E402

__all__ = ["GPUS_COLUMN", "link", "markdown_table", "plt", "save_png"]

# The node shape's GPUs per node as a table column ("-" for a plan made before GPUs per node was a choice).
GPUS_COLUMN = [("GPUs/node", "gpus_per_node", "d")]


def link(target: Path, report: Path) -> str:
    """A markdown link target: the path of `target` relative to the folder holding `report`."""
    return Path(os.path.relpath(target, Path(report).parent)).as_posix()


def save_png(fig, out: Path) -> None:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """`rows` as a markdown table of `columns` (title, key, format); a missing or None value shows as "-"."""
    head = "| " + " | ".join(title for title, _, _ in columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join(
        "| " + " | ".join("-" if r.get(key) is None else format(r[key], fmt) for _, key, fmt in columns) + " |\n"
        for r in rows
    )
