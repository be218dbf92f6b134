"""The figures of a comparison of methods over seeds, one drawing for the compare command
(``launch/compare.py``) and the evidence matrix (``bench/evidence/report.py``): each row's
accuracy per round (mean over seeds, band: min..max) and each row's accuracy (the mean of its
last rounds, ± std over seeds) against its total uplink."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from comparison.stats import LAST_ROUNDS

# a row's curves: the rounds every seed evaluated, and one curve over them per seed
Curves = tuple[Sequence[int], Sequence[Sequence[float]]]
# a row's point: total uplink MB, accuracy mean, accuracy std
Point = tuple[float, float, float]


def figure(width: float, height: float, columns: int = 1) -> tuple[Any, Any]:
    """A figure of ``columns`` axes side by side, drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=(width, height), squeeze=False)
    return fig, axes[0]


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


# A scenario of the evidence matrix has up to 12 rows: matplotlib's ten ``tab10`` colours,
# then black and navy, no two of one hue family (a pale shade of a colour beside it, as
# ``tab20``'s, reads as the same row on a busy plot); ``tab20``'s pale shades only beyond 12
DISTINCT_COLOURS = 12


def row_style(index: int) -> dict[str, Any]:
    """The ``index``-th row's colour, line style and marker: 12 colours of distinct hues (or
    grey, black), then pale ones, so that no two of up to 22 rows share a colour, and line
    styles and markers that change from one row to the next as well."""
    from matplotlib import colormaps

    if index < 10:
        colour = colormaps["tab10"](index)
    elif index < DISTINCT_COLOURS:
        colour = ("black", "navy")[index - 10]
    else:
        colour = colormaps["tab20"]((2 * (index - DISTINCT_COLOURS)) % 20 + 1)
    return {"color": colour, "linestyle": LINE_STYLES[index % 4],
            "marker": MARKERS[index % len(MARKERS)]}


def draw_curves(ax: Any, rows: Mapping[str, Curves]) -> None:
    """Each row's curve over rounds (mean over seeds, band: min..max), ticks on whole
    rounds only (a run of 2 rounds has no round 1.5)."""
    from matplotlib.ticker import MaxNLocator

    for index, (label, (rounds, curves)) in enumerate(rows.items()):
        array = np.asarray(curves, dtype=float)
        style = row_style(index)
        ax.plot(rounds, array.mean(0), label=label, color=style["color"],
                linestyle=style["linestyle"])
        ax.fill_between(rounds, array.min(0), array.max(0), alpha=0.12, color=style["color"])
    ax.set(xlabel="round", ylabel="personalized accuracy (weighted)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_accuracy_vs_uplink(ax: Any, rows: Mapping[str, Point]) -> None:
    """Each row's accuracy (± std) against its uplink, each point labelled beside it (rows
    of equal uplink and accuracy, FedAvg's and FedProx's say, would hide each other); a log
    axis only where the uplinks span more than a factor of 10."""
    uplinks = [mb for mb, _, _ in rows.values()]
    wide = bool(uplinks) and min(uplinks) > 0 and max(uplinks) / min(uplinks) > 10
    for index, (label, (mb_up, mean, std)) in enumerate(rows.items()):
        style = row_style(index)
        ax.errorbar(mb_up, mean, yerr=std, fmt=style["marker"], color=style["color"],
                    label=label)
        ax.annotate(label, (mb_up, mean), xytext=(4, 4 + 7 * (index % 3)),
                    textcoords="offset points", fontsize=6, color=style["color"])
    ax.set(xlabel=f"uplink MB (total{', log' if wide else ''})",
           ylabel=f"accuracy (last {LAST_ROUNDS} rounds)", xscale="log" if wide else "linear")


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
