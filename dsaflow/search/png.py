"""search.png: calibration loss against the F layers kept, one point per greedy step, drawn with matplotlib.

matplotlib is an optional extra (`pip install 'dsaflow[plots]'`): without it the search still writes every table
(search.csv holds the same numbers) and says that the figure was not drawn and how to get it. The figure is built
with matplotlib's object API (Figure + the Agg canvas), so a caller's pyplot backend and state are left alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

MISSING = (
    "matplotlib is not installed, so search.png was not drawn (search.csv has the same numbers). "
    "Fix: pip install 'dsaflow[plots]' (or pip install matplotlib)."
)


def search_figure(num_f: Sequence[int], losses: Sequence[float], removed: Sequence[Optional[int]], title: str):
    """-> a matplotlib Figure: calibration loss (y) per number of F layers kept (x, falling left to right, as the
    search runs), each point labelled with its loss and the layer whose indexer that step removed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    ax.plot(num_f, losses, "o-", color="tab:blue")
    for x, y, r in zip(num_f, losses, removed):
        if math.isfinite(y):
            label = f"{y:.4f}" + ("" if r is None else f"\n-L{r}")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
    ax.set_xlabel("F layers kept (layers that run their own indexer)")
    ax.set_ylabel("calibration loss")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(sorted(set(num_f)))
    if len(set(num_f)) > 1:
        ax.invert_xaxis()  # the search removes indexers: time runs left to right
    ax.margins(x=0.08, y=0.2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_search_png(
    path: str | Path, num_f: Sequence[int], losses: Sequence[float], removed: Sequence[Optional[int]], title: str
) -> Optional[str]:
    """Draw `search_figure` into `path`. -> None when written, else the reason it was not (matplotlib missing)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return MISSING
    fig = search_figure(num_f, losses, removed, title)
    FigureCanvasAgg(fig).print_png(str(path))
    return None
