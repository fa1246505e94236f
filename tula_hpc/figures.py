"""The report's figures: matplotlib without a display, PNGs written atomically, links relative to the report."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .files import atomic_path  # noqa: E402

__all__ = ["link", "plt", "save_png"]


def link(target: Path, report: Path) -> str:
    """A markdown link target: the path of `target` relative to the folder holding `report`."""
    return Path(os.path.relpath(target, Path(report).parent)).as_posix()


def save_png(fig, out: Path) -> None:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
